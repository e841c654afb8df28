"""HFText streams Arrow, Parquet and JSONL shards, tokenized as they are read, into TokenWindows'
own windows; its endless stream shuffles blocks of documents and resumes anywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bpe_helpers import build_tokenizer
from dew.data.base import DataPartition
from dew.testing import DatasetReaderKit

pytest.importorskip("pyarrow")

WORDS = "the a dew jax model trains data windows packed tokens quickly slowly café über".split()
LENGTH = 31


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 40)))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 300 documents as JSONL, as Parquet (row groups of 64) and as a save_to_disk folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    texts = _documents(300)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"id": list(range(300)), "text": texts}), folder / "docs.parquet", row_group_size=64)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "saved"), num_shards=3)
    tokenizer = build_tokenizer(folder / "tokenizer") / "tokenizer.json"
    return folder, texts, str(tokenizer)


def test_parquet_and_arrow_give_token_windows_own_windows(corpus):
    """The windows in stored order are exactly what TokenWindows makes of the same text as JSONL."""
    from dew.data.hf_text import HFText
    from dew.data.token_windows import TokenWindows

    folder, _, tokenizer = corpus
    expected = TokenWindows(files=str(folder / "docs.jsonl"), length=LENGTH, tokenizer=tokenizer).windows()
    for files in (str(folder / "docs.parquet"), str(folder / "saved")):
        source = HFText(files=files, length=LENGTH, tokenizer=tokenizer, block=7).records()
        got = source.take(np.arange(len(source)))
        assert len(source) == len(expected)
        assert np.array_equal(got["text"], expected)
        # a window's segments restart after each end-of-document id
        eos = source.tokenizer.eos_id
        after = np.concatenate([np.zeros((len(expected), 1), bool), expected[:, :-1] == eos], axis=1)
        assert np.array_equal(got["segment_ids"], 1 + np.cumsum(after, axis=1))


def test_an_epoch_is_the_blocks_in_a_seeded_order(corpus):
    """One epoch of the endless stream is every block's tokens, blocks in epoch_order, cut into windows."""
    from dew.data.hf_text import HFText
    from dew.data.hf_tokenizer import HFTokenizer
    from dew.data.order import epoch_order

    folder, texts, tokenizer = corpus
    block = 5
    source = HFText(files=str(folder / "docs.parquet"), length=LENGTH, tokenizer=tokenizer, block=block).records()
    encoder = HFTokenizer.from_file(tokenizer)
    blocks = [texts[b * block:(b + 1) * block] for b in range(-(-len(texts) // block))]
    for epoch in (0, 1):
        order = epoch_order(len(blocks), 9, epoch)
        stream = np.concatenate([np.asarray(encoder.encode(t, add_eos=True)) for b in order for t in blocks[b]])
        windows = source.endless(9)(np.arange(epoch * len(source), (epoch + 1) * len(source)))["text"]
        assert np.array_equal(windows.reshape(-1), stream[: len(source) * (LENGTH + 1)])


class TestHFTextReader(DatasetReaderKit):
    """Saved positions resume the stream on one process and on 2 or 3, crossing an epoch."""

    shares = (2, 3)
    before, after = 4, 5

    @pytest.fixture(autouse=True)
    def _corpus(self, corpus):
        self.corpus = corpus

    def dataset(self):
        from dew.data.hf_text import HFText

        folder, _, tokenizer = self.corpus
        return HFText(files=str(folder / "docs.parquet"), length=LENGTH, tokenizer=tokenizer,
                      block=4).load(batch=6 * 22, seed=1)  # 9 batches: more than the 208 windows


WORKERS = """
import sys
import numpy as np

def main():  # no absl app: nothing parses Grain's flags, which its workers read
    from dew.data.base import DataPartition
    from dew.data.hf_text import HFText
    files, tokenizer = sys.argv[1], sys.argv[2]
    # Blocks counted by two index workers, then read by two workers, against one process doing both.
    readers = [HFText(files=files, length=31, tokenizer=tokenizer, block=3, index_workers=w) for w in (0, 2)]
    streams = [reader.load(batch=8, seed=2, workers=w).train(DataPartition()) for reader, w in zip(readers, (0, 2))]
    batches = [[next(s) for _ in range(12)] for s in streams]
    for s in streams:
        s.close()
    same = all(np.array_equal(a[k], b[k]) for a, b in zip(*batches) for k in a)
    print("stream", same)

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_workers_tokenize_the_same_stream(corpus, tmp_path):
    """Two Grain worker processes tokenizing on the fly (and two counting the blocks' tokens first) yield
    exactly the stream one process does, in a program that never parsed absl's flags."""
    import subprocess
    import sys

    from dew.testing.processes import device_env

    folder, _, tokenizer = corpus
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    result = subprocess.run([sys.executable, str(script), str(folder / "docs.jsonl"), tokenizer],
                            env=device_env(1), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stream True" in result.stdout


def test_validation_holds_out_whole_blocks(corpus):
    from dew.data.hf_text import HFText

    folder, _, tokenizer = corpus
    data = HFText(files=str(folder / "docs.parquet"), length=LENGTH, tokenizer=tokenizer,
                  block=10).load(batch=2, val_fraction=0.2, val_seed=3)
    train, val = data.train.source, data.val.source
    assert set(train.blocks.tolist()).isdisjoint(val.blocks.tolist())
    assert len(train.blocks) + len(val.blocks) == 30 and len(val.blocks) == 6
    rows = np.concatenate([b["text"] for b in data.val(DataPartition())])
    assert np.array_equal(rows, val.take(np.arange(len(rows)))["text"])


def test_a_missing_column_names_the_file_the_column_and_the_columns(corpus):
    from dew.data.errors import MissingKeyError
    from dew.data.hf_text import HFText

    folder, _, tokenizer = corpus
    for name, columns in (("docs.parquet", r"\['id', 'text'\]"), ("docs.jsonl", r"\['id', 'text'\]")):
        # the way on names the reader's own field (it listed text_key= and messages_key= to every reader)
        with pytest.raises(MissingKeyError, match=rf"{name}' has no column 'body'; its columns are {columns}\. "
                                                  r"Name the column that holds it with the reader's field for 'body' "
                                                  r"\(a \.\.\._key field: dew describe READER lists them\)"):
            HFText(files=str(folder / name), text_key="body", tokenizer=tokenizer).records()


def test_a_corpus_changed_since_its_index_is_refused(corpus, tmp_path):
    """The cached token counts are checked as blocks are tokenized: an edited shard is named."""
    from dew.data.hf_text import HFText, StaleIndexError

    folder, texts, tokenizer = corpus
    shard = tmp_path / "docs.jsonl"
    shard.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    reader = HFText(files=str(shard), length=LENGTH, tokenizer=tokenizer, cache_dir=str(tmp_path / "cache"))
    counts = reader.token_counts()
    assert len(os.listdir(tmp_path / "cache")) == 2  # the counts and their record
    info = shard.stat()
    shard.write_text(shard.read_text().replace("dew", "wed"))  # same size, other tokens
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert np.array_equal(reader.token_counts(), counts)  # the stale index is what the key finds
    with pytest.raises(StaleIndexError, match="Block 0 .*docs.jsonl.*changed since"):
        reader.records().take(np.arange(3))


def test_a_position_saved_over_a_corpus_edited_since_is_refused(corpus, tmp_path):
    """The first and last documents swapped: as many tokens and windows, so the saved position
    (records, seed, size) fitted, and the resume read other windows without a word."""
    from dew.data.hf_text import HFText
    from dew.data.stream import PositionMismatchError, train_stream

    folder, texts, tokenizer = corpus
    shard = tmp_path / "docs.jsonl"
    shard.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    reader = HFText(files=str(shard), length=LENGTH, tokenizer=tokenizer)
    stream = train_stream(reader.records(), batch=4, seed=0)
    next(stream)
    saved = stream.get_state()
    train_stream(HFText(files=str(shard), length=LENGTH, tokenizer=tokenizer).records(), batch=4).set_state(saved)
    edited = [texts[-1], *texts[1:-1], texts[0]]
    assert len(texts[0].split()) != len(texts[-1].split())  # in blocks of other lengths now
    shard.write_text("".join(json.dumps({"text": t}) + "\n" for t in edited))
    again = HFText(files=str(shard), length=LENGTH, tokenizer=tokenizer).records()
    assert len(again) == len(reader.records())  # the windows fit in as many: only the digests tell
    with pytest.raises(PositionMismatchError, match=r"another version of .*docs\.jsonl: the file was edited"):
        train_stream(again, batch=4).set_state(saved)


def test_a_position_saved_over_a_shard_edited_keeping_every_token_count_is_refused_naming_it(corpus, tmp_path):
    """A word swapped for one of as many tokens: every block's token count stays, so the digest of
    the counts fitted, the resume read the new text, and dew audit --against called the run
    identical. The position keeps a (sampled) digest of each shard's bytes."""
    from dew.data.hf_text import HFText
    from dew.data.stream import PositionMismatchError, train_stream

    folder, texts, tokenizer = corpus
    shards = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for shard, part in zip(shards, (texts[:20], texts[20:]), strict=True):
        shard.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    reader = HFText(files=[str(s) for s in shards], length=LENGTH, tokenizer=tokenizer)
    stream = train_stream(reader.records(), batch=4, seed=0)
    next(stream)
    saved = stream.get_state()
    counts = reader.token_counts()
    text = shards[1].read_text()
    lines = text.splitlines(keepends=True)
    shards[1].write_text("".join([lines[1], lines[0], *lines[2:]]))  # two documents of one block swapped
    again = HFText(files=[str(s) for s in shards], length=LENGTH, tokenizer=tokenizer)
    assert np.array_equal(again.token_counts(), counts)  # only the files' bytes tell
    with pytest.raises(PositionMismatchError, match=r"another version of .*b\.jsonl: the file was edited"):
        train_stream(again.records(), batch=4).set_state(saved)
    shards[1].write_text(text)  # restored: the run goes on
    train_stream(HFText(files=[str(s) for s in shards], length=LENGTH, tokenizer=tokenizer).records(),
                 batch=4).set_state(saved)


def test_a_saved_dataset_dict_asks_for_one_split_and_its_metadata_is_no_shard(corpus, tmp_path):
    """save_to_disk of splits writes dataset_dict.json and a folder per split: the root is refused
    naming the splits (its metadata JSON was read as a shard of text); a folder of files beside
    datasets' metadata reads only the data."""
    import datasets

    from dew.data.errors import MissingFileError
    from dew.data.hf_text import HFText

    folder, texts, _ = corpus
    split = datasets.Dataset.from_dict({"text": texts[:20]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(MissingFileError, match=r"splits \(test, train\).*'.*splits/train'"):
        HFText(files=str(tmp_path / "splits")).shards()
    assert len(HFText(files=str(tmp_path / "splits" / "train")).shards()) == 20

    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:7]))
    (loose / "dataset_info.json").write_text(json.dumps({"description": "", "features": {}}))
    assert len(HFText(files=str(loose)).shards()) == 7


def test_a_folder_of_several_splits_is_refused_naming_each_splits_files(corpus, tmp_path):
    """A hub dataset's data/ folder (train-00000-of-00002.parquet, test-...) and a datasets cache
    folder (parquet-train.arrow, parquet-test.arrow) were read whole: a run trained on the test
    split too, without a word. Each split's files are named; one split's glob reads it alone."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dew.data.errors import MissingFileError
    from dew.data.hf_text import HFText

    _, texts, _ = corpus
    hub = tmp_path / "snapshot" / "data"
    hub.mkdir(parents=True)
    for name, part in (("train-00000-of-00002", texts[:10]), ("train-00001-of-00002", texts[10:20]),
                       ("test-00000-of-00001", texts[20:25]), ("train_sft-00000-of-00001-8a1b", texts[25:28])):
        pq.write_table(pa.table({"text": part}), hub / f"{name}.parquet")
    with pytest.raises(MissingFileError, match=r"holds the files of 3 splits \(test: test-\*\.parquet; train: "
                       r"train-\*\.parquet; train_sft: train_sft-\*\.parquet\); read whole, the run would train "
                       r"on all of them\. Pass the files of the split to read, e\.g\. '.*data/train-\*\.parquet'"):
        HFText(files=str(hub)).shards()
    train = HFText(files=str(hub / "train-*.parquet"), length=LENGTH)
    assert len(train.shards()) == 20 and train.shards().values(0, 20) == texts[:20]
    assert len(HFText(files=str(hub / "*.parquet")).shards()) == 28  # a glob of them all: one corpus, as asked

    datasets.Dataset.from_dict({"text": texts[:6]}).to_parquet(str(tmp_path / "p.parquet"))
    cache = datasets.load_dataset("parquet", data_files={"train": str(tmp_path / "p.parquet"),
                                                          "test": str(tmp_path / "p.parquet")},
                                  cache_dir=str(tmp_path / "hf-cache"))
    folder = Path(cache["train"].cache_files[0]["filename"]).parent
    assert (folder / "dataset_info.json").is_file()
    with pytest.raises(MissingFileError, match=r"2 splits \(test: parquet-test\*\.arrow; train: parquet-train\*\.arrow\)"):
        HFText(files=str(folder)).shards()
    assert len(HFText(files=str(folder / "parquet-train*.arrow")).shards()) == 6
