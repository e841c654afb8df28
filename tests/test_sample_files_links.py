"""The files `dew generate --out DIR` writes (samples.txt; samples.png and one image each) replace
a link planted at their name instead of writing through it: a sample directory that names a file
outside it cannot make dew overwrite that file (issue 37: nothing outside OUT changes)."""

from __future__ import annotations

import os

import numpy as np


def _planted(tmp_path, names):
    out = tmp_path / "out"
    out.mkdir()
    outside = {}
    for name in names:
        victim = tmp_path / f"outside-{name}"
        victim.write_text("precious")
        os.symlink(victim, out / name)
        outside[name] = victim
    return out, outside


def test_sample_texts_replace_a_planted_link(tmp_path):
    from dew.objectives.inference import write_texts

    out, outside = _planted(tmp_path, ["samples.txt"])
    (path,) = write_texts(("one", "two"), out)
    assert outside["samples.txt"].read_text() == "precious"
    assert not path.is_symlink() and path.read_text() == "one\n---\ntwo\n"
    assert sorted(p.name for p in out.iterdir()) == ["samples.txt"]  # no temporary file left
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as a plain write would make it


def test_embeddings_replace_a_planted_link(tmp_path):
    from dew.cli.embed import _save_vectors

    out, outside = _planted(tmp_path, ["vectors.npy"])
    vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = _save_vectors(out / "vectors.npy", vectors)
    assert outside["vectors.npy"].read_text() == "precious"
    assert not path.is_symlink() and np.array_equal(np.load(path), vectors)
    assert sorted(p.name for p in out.iterdir()) == ["vectors.npy"]  # no temporary file left


def test_sample_images_replace_planted_links(tmp_path):
    from PIL import Image

    from dew.objectives.diffusion_pipeline import write_samples

    out, outside = _planted(tmp_path, ["samples.png", "sample_001.png"])
    pixels = np.zeros((2, 4, 4, 3), np.uint8)
    pixels[1] = 255
    files = write_samples(pixels, out, video=False, columns=2)
    assert [f.name for f in files] == ["samples.png", "sample_000.png", "sample_001.png"]
    assert all(v.read_text() == "precious" for v in outside.values())
    assert not any(f.is_symlink() for f in files)
    with Image.open(out / "sample_001.png") as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), pixels[1])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_samples_written_into_a_used_folder_are_that_request_alone(tmp_path):
    """A second dew generate --out into the folder of a first that drew more samples replaced
    sample_000 and left sample_001.. beside it, reading as one request of four. Other files stay."""
    from dew.objectives.diffusion_pipeline import write_samples

    out = tmp_path / "out"
    pixels = np.zeros((4, 8, 8, 1), np.uint8)
    assert len(write_samples(pixels, out, video=False, columns=2)) == 5
    (out / "notes.txt").write_text("mine")
    (out / "sample_001.gif").write_bytes(b"a clip of another kind")
    written = write_samples(pixels[:1] + 7, out, video=False, columns=2)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sample_000.png", "sample_001.gif", "samples.png"]
    assert [p.name for p in written] == ["samples.png", "sample_000.png"]


def test_a_sample_folder_that_cannot_be_made_is_not_blamed_on_the_disk(tmp_path):
    """An --out naming an existing file was told to free space on its disk."""
    import pytest

    from dew.objectives.diffusion_pipeline import write_samples
    from dew.objectives.inference import SampleWriteError

    (tmp_path / "taken").write_text("a file")
    with pytest.raises(SampleWriteError, match=r"\(File exists\); choose another --out, a folder \(or a name for "
                                               r"one\) you may write\.$"):
        write_samples(np.zeros((1, 8, 8, 1), np.uint8), tmp_path / "taken", video=False, columns=1)



def test_a_full_disk_is_told_to_free_space():
    import errno

    from dew.objectives.inference import SampleWriteError

    full = SampleWriteError("out", OSError(errno.ENOSPC, "No space left on device"), ("a text",))
    assert str(full) == ("The samples could not be written to out (No space left on device); free space on its "
                         "disk or choose another --out; the text is printed above.")
