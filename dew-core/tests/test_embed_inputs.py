"""What `dew embed` reads: arrays and image files stacked in order, and inputs that are neither
refused by name (numpy's own advice for a text file, allow_pickle, would run what the file holds)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from dew.cli.embed import InputImagesError, read_inputs


def test_arrays_and_images_stack_in_order(tmp_path):
    first = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8, 1)
    np.save(tmp_path / "two.npy", first)
    Image.fromarray(np.full((8, 8), 7, np.uint8)).save(tmp_path / "one.png")
    stacked = read_inputs([tmp_path / "two.npy", tmp_path / "one.png"])
    assert stacked.shape == (3, 8, 8, 1)
    np.testing.assert_array_equal(stacked[:2], first)
    assert (stacked[2] == 7).all()


def test_inputs_that_are_not_images_are_named(tmp_path):
    (tmp_path / "notes.npy").write_text("not an array\n")
    (tmp_path / "notes.png").write_text("not an image\n")
    with pytest.raises(InputImagesError, match="notes.npy is not a NumPy array file") as refused:
        read_inputs([tmp_path / "notes.npy"])
    assert "allow_pickle" not in str(refused.value)
    with pytest.raises(InputImagesError, match="notes.png is not an image Pillow can read"):
        read_inputs([tmp_path / "notes.png"])
    np.save(tmp_path / "small.npy", np.zeros((1, 4, 4, 1), np.uint8))
    np.save(tmp_path / "large.npy", np.zeros((1, 8, 8, 1), np.uint8))
    with pytest.raises(InputImagesError, match="different shapes"):
        read_inputs([tmp_path / "small.npy", tmp_path / "large.npy"])


def test_grayscale_files_of_every_depth_read_as_one_channel_and_values_that_are_no_pixels_are_named(tmp_path):
    """A 16-bit grayscale PNG and a gray+alpha PNG were read as RGB and refused as 3 channels; an
    array of dates reached JAX and printed its traceback (a complex one lost its imaginary part)."""
    digit = np.arange(64, dtype=np.uint8).reshape(8, 8) * 3
    Image.fromarray(digit.astype(np.uint16) * 257).save(tmp_path / "sixteen.png")
    Image.fromarray(digit).convert("LA").save(tmp_path / "alpha.png")
    Image.fromarray(digit.astype(np.float32) / 255).save(tmp_path / "float.tiff")
    assert Image.open(tmp_path / "sixteen.png").mode.startswith("I")
    stacked = read_inputs([tmp_path / "sixteen.png", tmp_path / "alpha.png"])
    assert stacked.shape == (2, 8, 8, 1) and stacked.dtype == np.uint8
    np.testing.assert_array_equal(stacked[..., 0], [digit, digit])
    floats = read_inputs([tmp_path / "float.tiff"])
    assert floats.shape == (1, 8, 8, 1) and np.allclose(floats[0, ..., 0], digit / 255)
    for dtype in ("datetime64[s]", [("a", "f4")], np.complex64):
        np.save(tmp_path / "odd.npy", np.zeros((2, 8, 8, 1), dtype))
        with pytest.raises(InputImagesError, match=r"hold values of dtype .*, not pixels; give images of numbers"):
            read_inputs([tmp_path / "odd.npy"])



def test_a_batch_of_grayscale_images_without_a_channel_axis_is_named_with_its_own_shape(tmp_path):
    """[5, 8, 8] was read as one image of 8 channels, and the model's refusal named (1, 5, 8, 8)."""
    np.save(tmp_path / "batch.npy", np.zeros((5, 8, 8), np.uint8))
    with pytest.raises(InputImagesError, match=r"batch.npy holds an array of shape \(5, 8, 8\).*array\[\.\.\., None\]"):
        read_inputs([tmp_path / "batch.npy"])
    np.save(tmp_path / "one.npy", np.zeros((8, 8, 3), np.uint8))  # one color image is still one image
    assert read_inputs([tmp_path / "one.npy"]).shape == (1, 8, 8, 3)
