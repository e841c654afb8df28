"""Image and video readers for diffusion: digits, moving digits, video arrays, HFImages into the
DiffusionObjective; positions are dew's global record count, as for every reader."""

from __future__ import annotations

import numpy as np
import pytest

from dew.data import DataPartition
from dew.data.digits import Digits, MovingDigits, digit_images
from dew.data.videos import FrameCountError, VideoArrays


def test_digits_are_sklearn_digits_as_uint8_with_labels():
    from sklearn.datasets import load_digits

    raw = load_digits()
    records = Digits(size=16).records()
    first = records[5]
    assert first["image"].shape == (16, 16, 1) and first["image"].dtype == np.uint8
    expected = np.round(raw.images[5] * 255 / 16).astype(np.uint8).repeat(2, 0).repeat(2, 1)
    np.testing.assert_array_equal(first["image"][..., 0], expected)
    assert int(first["label"]) == raw.target[5]


def test_moving_digits_move_the_same_digit_in_straight_bouncing_lines():
    videos = MovingDigits(frames=6, size=12).records()
    images, labels = digit_images()
    record = videos[7]
    assert record["video"].shape == (6, 12, 12, 1) and int(record["label"]) == labels[7]
    for frame in record["video"][..., 0]:
        # The digit appears whole in every frame, somewhere inside the canvas.
        found = [(y, x) for y in range(5) for x in range(5)
                 if np.array_equal(frame[y:y + 8, x:x + 8], images[7])]
        assert found, "the digit is not in the frame"


def test_video_arrays_resume_at_the_same_global_record(tmp_path):
    rng = np.random.default_rng(0)
    videos = rng.integers(0, 256, (12, 3, 4, 4, 1)).astype(np.uint8)
    np.save(tmp_path / "videos.npy", videos)
    np.save(tmp_path / "labels.npy", np.arange(12))
    data = VideoArrays(str(tmp_path / "videos.npy"), frames=3,
                       labels=str(tmp_path / "labels.npy")).load(batch=4, seed=1)
    stream = data.train(DataPartition())
    first, second = next(stream), next(stream)
    state = stream.get_state()
    third = next(stream)
    again = data.train(DataPartition())
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["video"], third["video"])
    for batch in (first, second, third):
        for video, label in zip(batch["video"], batch["label"], strict=True):
            np.testing.assert_array_equal(video, videos[label])
    with pytest.raises(FrameCountError, match="videos of 3 frames, but frames=5"):
        VideoArrays(str(tmp_path / "videos.npy"), frames=5).records()


def test_hf_images_from_a_local_folder_feed_the_diffusion_objective(tmp_path):
    import datasets
    import jax
    import jax.numpy as jnp
    from PIL import Image

    from dew.data import HFImages
    from dew.nn.dit import DiT
    from dew.objectives.base import Step
    from dew.objectives.diffusion import DiffusionObjective

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(6)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": pictures, "label": [0, 1, 2, 0, 1, 2]},
                               features=features).save_to_disk(str(tmp_path / "folder"))
    batch = next(HFImages(dataset=str(tmp_path / "folder"), size=8).load(batch=3).train(DataPartition()))
    model = DiT(image_size=8, channels=3, patch_size=4, emb_features=16, num_layers=1,
                num_heads=2, mlp_features=32, num_classes=3)
    objective = DiffusionObjective(model)
    x0 = objective.pixels(batch)
    np.testing.assert_allclose(np.asarray(x0), batch["image"] / 127.5 - 1, atol=1e-6)
    variables = objective.init(jax.random.key(0))
    step = Step(jnp.int32(0), jnp.int32(0), jnp.int32(0), jax.random.key(1))
    loss, _ = objective.loss(variables, batch, step)
    assert np.isfinite(float(loss.value))
