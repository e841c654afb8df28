"""TokenWindows: packing against a hand computation, every input kind, tokenizers, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from dew.data import DataPartition, HFTokenizer, TokenWindows
from dew.data.errors import (
    EmptyDatasetError,
    MalformedRecordError,
    MissingFileError,
    MissingKeyError,
)
from dew.data.sources import stdlib_corpus

DOCS = ["dew trains jax models.", "a longer document " * 9, "é ünïcode ✓", "short"]


def packed_bytes(docs: list[str], length: int) -> np.ndarray:
    """The windows by hand: bytes of each document then 256, cut every length + 1 ids."""
    ids: list[int] = []
    for doc in docs:
        ids += list(doc.encode("utf-8")) + [256]
    count = len(ids) // (length + 1)
    return np.asarray(ids[: count * (length + 1)], np.int32).reshape(count, length + 1)


@pytest.fixture
def text_files(tmp_path: Path) -> list[Path]:
    paths = []
    for i, doc in enumerate(DOCS):
        path = tmp_path / "txt" / f"{i:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(doc, encoding="utf-8")
        paths.append(path)
    return paths


def test_text_files_pack_into_windows_with_end_of_document_ids(text_files, tmp_path):
    windows = TokenWindows(files=str(tmp_path / "txt" / "*.txt"), length=15).windows()
    assert windows.dtype == np.int32 and windows.shape[1] == 16
    np.testing.assert_array_equal(windows, packed_bytes(DOCS, 15))
    assert (windows == 256).sum() >= 3  # documents end inside windows; the long one spans several


def test_jsonl_parquet_and_a_saved_hf_dataset_give_the_same_windows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)) + "\n")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": DOCS}), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(saved))

    want = packed_bytes(DOCS, 11)
    for reader in (TokenWindows(files=[jsonl], text_key="body", length=11),
                   TokenWindows(files=[parquet], text_key="body", length=11),
                   TokenWindows(dataset=str(saved), text_key="body", length=11)):
        np.testing.assert_array_equal(reader.windows(), want)


def test_a_local_tokenizer_json_tokenizes_through_hf_tokenizer(tmp_path, text_files):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS * 5, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    tokenizer = HFTokenizer.from_file(path)
    assert tokenizer.eos_id == tok.token_to_id("</s>")
    ids: list[int] = []
    for doc in DOCS:
        ids += tok.encode(doc, add_special_tokens=False).ids + [tokenizer.eos_id]
    want = np.asarray(ids[: len(ids) // 8 * 8], np.int32).reshape(-1, 8)
    got = TokenWindows(files=[str(p) for p in text_files], tokenizer=str(path), length=7).windows()
    np.testing.assert_array_equal(got, want)
    assert tokenizer.decode(tokenizer.encode("dew trains")).replace(" ", "") == "dewtrains"
    with pytest.raises(MissingKeyError, match="no end-of-document token"):
        HFTokenizer.from_file(path, eos_token="<nope>")
    with pytest.raises(MissingFileError, match="missing.json. does not exist. Pass a checkpoint.s folder .its tokenizer.json"):
        HFTokenizer.from_file(tmp_path / "missing.json")


def test_windows_are_cached_on_disk_and_the_cache_follows_the_inputs(tmp_path, text_files):
    reader = TokenWindows(files=[str(p) for p in text_files], length=9, cache_dir=str(tmp_path / "cache"))
    first = reader.windows()
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    again = reader.windows()
    assert isinstance(again, np.memmap)
    np.testing.assert_array_equal(again, first)
    text_files[0].write_text("changed text, changed windows")
    changed = reader.windows()
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 2
    np.testing.assert_array_equal(changed, packed_bytes(["changed text, changed windows", *DOCS[1:]], 9))


def test_cached_windows_travel_to_workers_as_a_file_name(tmp_path, text_files):
    import pickle

    reader = TokenWindows(files=[str(p) for p in text_files], length=9, cache_dir=str(tmp_path / "c"))
    reader.windows()
    records = reader.records().subset(np.asarray([3, 1, 2]))
    blob = pickle.dumps(records)
    back = pickle.loads(blob)
    assert isinstance(back.columns["text"], np.memmap)
    assert Path(back.columns["text"].filename).parent == tmp_path / "c"
    np.testing.assert_array_equal(back.take(np.arange(3))["text"], reader.windows()[[3, 1, 2]])


def test_load_holds_out_validation_windows_and_streams_the_rest(text_files):
    from collections import Counter

    from dew.data.token_windows import split_records

    reader = TokenWindows(files=[str(p) for p in text_files], length=5)
    windows = reader.windows()
    data = reader.load(batch=4, seed=0, val_fraction=0.25)
    held = round(len(windows) * 0.25)
    assert data.records == len(windows) - held and data.batch == 4
    _, val_split = split_records(reader.records(), 0.25, 0)
    val_rows = Counter(map(tuple, val_split.take(np.arange(held))["text"].tolist()))
    # One epoch of the train stream plus the held-out windows is every window once.
    stream = data.train(DataPartition())
    epoch = np.concatenate([next(stream)["text"] for _ in range(-(-data.records // 4))])[: data.records]
    assert Counter(map(tuple, epoch.tolist())) + val_rows == Counter(map(tuple, windows.tolist()))
    val = np.concatenate([b["text"] for b in data.val(DataPartition())])
    assert len(val) == held // 4 * 4  # the last partial global batch is dropped
    np.testing.assert_array_equal(val, val_split.take(np.arange(len(val)))["text"])
    halves = [next(data.train(DataPartition(s, 2)))["text"] for s in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), next(data.train(DataPartition()))["text"])


def test_stdlib_corpus_is_deterministic_python_source():
    files = stdlib_corpus()
    assert files == stdlib_corpus() and len(files) > 100
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    assert stdlib_corpus(limit_files=5) == files[:5]
    windows = TokenWindows(files=stdlib_corpus(limit_files=3), length=128).windows()
    text = b"".join(f.read_bytes() + b"" for f in files[:3])
    assert windows.shape[0] == (len(text) + 3) // 129


def test_bad_inputs_name_the_file_the_key_or_the_sizes(tmp_path):
    with pytest.raises(MissingFileError, match="nowhere.txt"):
        TokenWindows(files=[str(tmp_path / "nowhere.txt")]).windows()
    with pytest.raises(MissingFileError, match=r"matches no file"):
        TokenWindows(files=str(tmp_path / "*.jsonl")).windows()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(EmptyDatasetError, match=r"hold 0 tokens"):
        TokenWindows(files=[str(tmp_path / "empty.txt")], length=8).windows()
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(EmptyDatasetError, match=r"hold 4 tokens.*length \+ 1 = 9"):
        TokenWindows(files=[str(tmp_path / "tiny.txt")], length=8).windows()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(MissingKeyError, match=r"Line 2 of .*bad.jsonl.* no key 'text'"):
        TokenWindows(files=[str(bad)]).windows()
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(MalformedRecordError, match=r"Line 2 of .*broken.jsonl"):
        TokenWindows(files=[str(broken)]).windows()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(MissingKeyError, match=r"t.parquet.*no column 'text'.*\['body'\]"):
        TokenWindows(files=[str(tmp_path / "t.parquet")]).windows()
    with pytest.raises(MissingFileError, match="no_such_dataset"):
        TokenWindows(dataset=str(tmp_path / "no_such_dataset")).windows()
    (tmp_path / "some.txt").write_text("x" * 40)
    with pytest.raises(EmptyDatasetError, match=r"holds out 1 windows, fewer than one global batch of 8"):
        TokenWindows(files=[str(tmp_path / "some.txt")], length=3).load(batch=8, val_fraction=0.1)


def test_a_null_text_is_no_document_and_a_non_string_or_non_utf8_line_is_named(tmp_path):
    """A JSONL record's null text trained as the word 'None' (and a number as its digits); a
    file that is not UTF-8 was blamed on data.load without its name or line."""
    from dew.data.prompt_completion import PromptCompletion

    files = tmp_path / "a.jsonl"
    files.write_text("".join(json.dumps({"text": t}) + "\n" for t in (None, "", "real")))
    assert TokenWindows(files=str(files), length=4).tokens().tolist() == [*b"real", 256]
    files.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": 12345}) + "\n")
    with pytest.raises(MalformedRecordError, match=r"'text' of line 2 of .*a\.jsonl' is a int, not a string"):
        TokenWindows(files=str(files), length=4).tokens()
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(MalformedRecordError, match=r"Line 2 of .*latin\.jsonl' is not UTF-8 text .*byte 0xe9"):
        TokenWindows(files=str(latin), length=4).tokens()
    image = tmp_path / "picture.png"  # a glob that picked up a binary file: its bytes were tokenized
    image.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(MalformedRecordError, match=r"picture\.png' holds NUL bytes, so it is no text file"):
        TokenWindows(files=str(image), length=4).tokens()
    latin.write_bytes(b'{"prompt": "caf\xe9", "completion": "x"}\n')
    with pytest.raises(MalformedRecordError, match=r"Line 1 of .*latin\.jsonl' is not UTF-8 text"):
        PromptCompletion(files=str(latin), length=8).rows()


def test_a_tokenizer_without_an_end_token_is_told_a_way_a_recipe_can_follow(tmp_path):
    """The advice was eos_token=, which no reader's recipe section accepts; naming it in the
    tokenizer_config.json beside the file, and giving the folder, is what a recipe can do."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "tokenizer"
    folder.mkdir()
    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "<stop>": 3}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(folder / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("a b a")
    with pytest.raises(MissingKeyError, match="as eos_token in a tokenizer_config.json beside it, then give the folder"):
        TokenWindows(files=str(tmp_path / "a.txt"), length=2, tokenizer=str(folder / "tokenizer.json")).tokens()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<stop>"}))
    assert TokenWindows(files=str(tmp_path / "a.txt"), length=2, tokenizer=str(folder)).tokens().tolist() == [1, 2, 1, 3]


def test_each_document_starts_as_transformers_starts_a_sequence_for_a_llama_checkpoint(tmp_path):
    """Llama's and Gemma's tokenizer.json put a beginning-of-text id first, and the checkpoints
    were pretrained on documents that start with it: windows cut from their text hold each
    document as transformers' tokenizer(text) encodes it, then its end id. Both readers agree."""
    from transformers import AutoTokenizer

    from dew.data.hf_text import HFText
    from dew.families.examples import write_checkpoint

    folder = write_checkpoint("llama", tmp_path / "llama")
    theirs = AutoTokenizer.from_pretrained(folder)
    assert theirs.bos_token_id is not None and theirs("x")["input_ids"][0] == theirs.bos_token_id
    files = tmp_path / "docs.jsonl"
    files.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    ids = [i for doc in DOCS for i in theirs(doc)["input_ids"] + [theirs.eos_token_id]]
    want = np.asarray(ids[: len(ids) // 8 * 8], np.int32).reshape(-1, 8)
    windows = TokenWindows(files=str(files), tokenizer=str(folder), length=7)
    np.testing.assert_array_equal(windows.windows(), want)
    streamed = HFText(files=str(files), tokenizer=str(folder), length=7, block=2).records()
    np.testing.assert_array_equal(streamed.take(np.arange(len(want)))["text"], want)
    # Windows cached before documents began with that id are not read back as these.
    from dew.data.token_windows import tokenizer_fingerprint

    plain = HFTokenizer.from_directory(folder)
    assert tokenizer_fingerprint(plain) == f"{plain.fingerprint}:starts[{theirs.bos_token_id}]"


def test_a_saved_dataset_whose_text_column_is_not_text_is_named_as_the_files_are(tmp_path):
    """Through dataset= a column of numbers or lists reached the tokenizer: an AttributeError
    ('int' object has no attribute 'encode') or the tokenizers library's TypeError."""
    import datasets

    datasets.Dataset.from_dict({"text": ["fine", "", None]}).save_to_disk(str(tmp_path / "good"))
    assert TokenWindows(dataset=str(tmp_path / "good"), length=4).tokens().tolist() == [*b"fine", 256]
    for name, column, kind in (("ints", [5, 6], "int"), ("lists", [["a"], ["b"]], "list")):
        datasets.Dataset.from_dict({"text": column}).save_to_disk(str(tmp_path / name))
        with pytest.raises(MalformedRecordError, match=rf"Row 1 of the dataset .*{name}' .* holds a {kind} "
                                                       r"under 'text', not a string"):
            TokenWindows(dataset=str(tmp_path / name), length=4).tokens()


def test_a_prompt_template_str_format_cannot_fill_is_refused_before_any_record(tmp_path):
    """Only '{prompt}' in the template was checked: a JSON example in it ('{"a": 1}'), another field or
    a lone brace raised KeyError or IndexError from str.format when the rows were built."""
    from dew.data.prompt_completion import PromptCompletion

    files = tmp_path / "sft.jsonl"
    files.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    for template, said in (('Reply as JSON like {"a": 1}. {prompt}', "names {\"a\"}"),
                           ("{prompt} {x}", "names {x}"), ("{prompt}{}", "names {}"),
                           ("{prompt} }", "cannot be filled"), ("no field", "must contain '{prompt}'")):
        with pytest.raises(ValueError, match=re.escape(said)):
            PromptCompletion(files=str(files), length=32, template=template)
        assert said in PromptCompletion.field_problems({"template": template})[0][1]  # dew train --check
    doubled = PromptCompletion(files=str(files), length=32, template='JSON like {{"a": 1}}. {prompt}').rows()
    ids, mask = doubled["text"][0], doubled["loss_mask"][0]
    assert bytes(ids[(mask == 0) & (ids < 256)].tolist()).decode() == 'JSON like {"a": 1}. 2+2='  # the prompt
    assert PromptCompletion.field_problems({"template": "Q: {prompt}"}) == []


def test_a_cache_folder_reads_its_split_and_a_wrong_config_or_split_is_named_in_one_line(tmp_path):
    """dataset= on a datasets cache folder (dataset_info.json beside parquet-train.arrow) was sent to
    load_from_disk and failed with a traceback; datasets' refusal of a config or split ran to four
    lines blaming data.load and advising load_dataset(...); a config given for a save_to_disk folder,
    which has none, was ignored."""
    import datasets

    from dew.data import TokenWindows
    from dew.data.errors import MissingKeyError

    for split, text in (("train", "ab"), ("test", "xyz")):
        datasets.Dataset.from_dict({"text": [text]}).to_parquet(str(tmp_path / f"{split}.parquet"))
    built = datasets.load_dataset("parquet", data_files={s: str(tmp_path / f"{s}.parquet") for s in ("train", "test")},
                                  cache_dir=str(tmp_path / "hf-cache"))
    cache = Path(built["train"].cache_files[0]["filename"]).parent
    for split, text in (("train", b"ab"), ("test", b"xyz")):
        assert TokenWindows(dataset=str(cache), split=split, length=2).tokens().tolist() == [*text, 256]

    configs = tmp_path / "configs"
    for config, splits in (("en", ("train", "test")), ("fr", ("train",))):
        (configs / config).mkdir(parents=True)
        for split in splits:
            datasets.Dataset.from_dict({"text": [f"{config} {split}"]}).to_parquet(
                str(configs / config / f"{split}-00000-of-00001.parquet"))
    (configs / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/train-*\n"
        "  - split: test\n    path: en/test-*\n- config_name: fr\n  data_files:\n  - split: train\n"
        "    path: fr/train-*\n---\n")
    assert TokenWindows(dataset=str(configs), config="fr", length=2).tokens().tolist() == [*b"fr train", 256]
    for given, said in (({}, r"has the configs \['en', 'fr'\] and none was named; pass config= with one of them "
                             r"\(a recipe's data\.config\)\.$"),
                        ({"config": "de"}, r"has the configs \['en', 'fr'\] and no config 'de'; pass config="),
                        ({"config": "fr", "split": "test"},
                         r"\(config 'fr'\) has no split 'test'; its splits are \['train'\]\. Pass split= with one "
                         r"of them \(a recipe's data\.split\)\.$")):
        with pytest.raises(MissingKeyError, match=said) as refused:
            TokenWindows(dataset=str(configs), length=2, **given).tokens()
        assert "\n" not in str(refused.value)

    datasets.Dataset.from_dict({"text": ["saved"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(MissingKeyError, match=r"written by datasets' save_to_disk, which keeps one dataset and no "
                       r"configs, so config='zzz' names nothing there"):
        TokenWindows(dataset=str(tmp_path / "saved"), config="zzz", length=2).tokens()
