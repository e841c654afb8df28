"""HFImages: a tiny image dataset written to disk, read back as fitted uint8 arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dew.data import DataPartition, HFImages
from dew.data.errors import EmptyDatasetError, MissingFileError, MissingKeyError


def make_images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = [(20, 30), (30, 20), (16, 16), (24, 40)]
    return [rng.integers(0, 256, size=(*shapes[i % 4], 3), dtype=np.uint8) for i in range(n)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[np.ndarray]]:
    import datasets
    from PIL import Image

    arrays = make_images(10)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    data = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(a) for a in arrays], "label": list(range(10))}, features=features)
    path = tmp_path_factory.mktemp("images") / "saved"
    datasets.DatasetDict({"train": data, "test": data.select(range(4))}).save_to_disk(str(path))
    return path, arrays


def expected(array: np.ndarray, size: int, fit: str) -> np.ndarray:
    """Pillow by hand: crop = scale the shorter side then cut the centre; resize = scale."""
    from PIL import Image

    image = Image.fromarray(array)
    if fit == "resize":
        return np.asarray(image.resize((size, size), Image.Resampling.BICUBIC))
    scale = size / min(image.size)
    w, h = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((w, h), Image.Resampling.BICUBIC) if (w, h) != image.size else image
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)))


@pytest.mark.parametrize("fit", ["crop", "resize"])
def test_images_arrive_as_fitted_uint8_with_labels(saved, fit):
    path, arrays = saved
    data = HFImages(dataset=str(path), size=12, fit=fit).load(batch=4, seed=3)
    assert data.records == 10
    batch = next(data.train(DataPartition()))
    assert batch["image"].dtype == np.uint8 and batch["image"].shape == (4, 12, 12, 3)
    assert batch["label"].dtype == np.int32
    for image, label in zip(batch["image"], batch["label"], strict=True):
        np.testing.assert_array_equal(image, expected(arrays[label], 12, fit))


def test_a_val_split_and_one_channel(saved):
    path, arrays = saved
    data = HFImages(dataset=str(path), size=(8, 10), val_split="test", channels=1).load(batch=2)
    val = list(data.val(DataPartition()))
    assert [b["label"].tolist() for b in val] == [[0, 1], [2, 3]]
    assert val[0]["image"].shape == (2, 8, 10, 1)
    halves = [next(data.train(DataPartition(s, 2))) for s in range(2)]
    whole = next(data.train(DataPartition()))
    np.testing.assert_array_equal(np.concatenate([h["image"] for h in halves]), whole["image"])


def test_held_out_fraction_is_disjoint_from_training(saved):
    path, _ = saved
    data = HFImages(dataset=str(path), size=8).load(batch=2, val_fraction=0.4)
    assert data.records == 6
    val = np.concatenate([b["label"] for b in data.val(DataPartition())]).tolist()
    stream = data.train(DataPartition())
    train = np.concatenate([next(stream)["label"] for _ in range(3)]).tolist()
    assert len(val) == 4 and sorted(val + train) == list(range(10))


def test_bad_inputs_name_the_path_split_or_column(saved, tmp_path):
    import datasets

    path, _ = saved
    with pytest.raises(MissingFileError, match="nope"):
        HFImages(dataset=str(tmp_path / "nope")).load(batch=2)
    with pytest.raises(MissingKeyError, match=r"no split 'validation'.*\['test', 'train'\]"):
        HFImages(dataset=str(path), split="validation").load(batch=2)
    with pytest.raises(MissingKeyError, match=r"no column 'pixels'.*\['image', 'label'\]"):
        HFImages(dataset=str(path), image_key="pixels").load(batch=2)
    with pytest.raises(MissingKeyError, match=r"no column 'class'"):
        HFImages(dataset=str(path), label_key="class").load(batch=2)
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"image": []}, features=datasets.Features({"image": datasets.Image()})).save_to_disk(str(empty), num_shards=1)
    with pytest.raises(EmptyDatasetError, match="holds no records"):
        HFImages(dataset=str(empty)).load(batch=2)


def test_a_file_that_is_no_image_is_named_when_its_batch_is_read(tmp_path, monkeypatch):
    """An image folder with one damaged file read fine until that record's batch, then failed
    with Pillow's traceback mid-run; the error names the file and what to do."""
    from PIL import Image

    from dew.data.images import UndecodableImageError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for i, array in enumerate(make_images(3)):
            Image.fromarray(array).save(tmp_path / label / f"{i}.png")
    (tmp_path / "dog" / "broken.png").write_bytes(b"this is not a png at all")
    stream = HFImages(dataset=str(tmp_path), size=8).load(batch=7).train(DataPartition())
    with pytest.raises(UndecodableImageError, match=r"file .*dog/broken\.png\) is not an image Pillow "
                                                    r"decodes.*Remove or replace it"):
        next(stream)
