"""Text files as editors and tools write them: a byte-order mark, a column of numbers, bytes that are
not UTF-8. Each is read as the text it holds or refused naming the file, the line or row, and the fix."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from dew.data.errors import MalformedRecordError


def test_a_byte_order_mark_is_no_text_in_a_plain_file_or_a_jsonl_one(tmp_path):
    """A BOM became the first three tokens of a plain file; a JSONL file that starts with one was refused."""
    from dew.data import TokenWindows

    text = "def f():\n    return 1\n" * 4
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    (tmp_path / "plain.txt").write_bytes(text.encode())
    with_mark = TokenWindows(files=str(tmp_path / "bom.txt"), length=8).windows()
    assert np.array_equal(with_mark, TokenWindows(files=str(tmp_path / "plain.txt"), length=8).windows())
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (json.dumps({"text": text}) + "\n").encode())
    (tmp_path / "plain.jsonl").write_text(json.dumps({"text": text}) + "\n")
    assert np.array_equal(TokenWindows(files=str(tmp_path / "bom.jsonl"), length=8).windows(),
                          TokenWindows(files=str(tmp_path / "plain.jsonl"), length=8).windows())



def test_windows_line_ends_a_mark_before_a_blank_line_and_utf16_are_read_as_python_reads_text(tmp_path):
    """CRLF line ends reached the byte tokenizer as a 13 before every newline (Python's own text mode
    and the datasets builder read none); a JSONL shard whose BOM stood alone on its first line was
    refused as invalid JSON by hf_text and chat (token_windows read it); a UTF-16 file was called
    "an image or an archive"."""
    from dew.data import HFText, TokenWindows

    (tmp_path / "crlf.txt").write_bytes(b"line one\r\nline two\r\nold mac\rend\r\n")
    with open(tmp_path / "crlf.txt", encoding="utf-8") as handle:  # Python's universal newlines
        expected = handle.read()
    assert "\r" not in expected
    read = TokenWindows(files=str(tmp_path / "crlf.txt"), length=4).tokens()
    assert read.tolist() == [*expected.encode(), 256]

    (tmp_path / "alone.jsonl").write_bytes(b"\xef\xbb\xbf\r\n" + b'{"text": "a"}\r\n{"text": "bc"}\r\n')
    (tmp_path / "plain.jsonl").write_bytes(b'{"text": "a"}\n{"text": "bc"}\n')
    alone, plain = (HFText(files=str(tmp_path / name), length=4).shards() for name in ("alone.jsonl", "plain.jsonl"))
    assert len(alone) == len(plain) == 2 and alone.values(0, 2) == plain.values(0, 2) == ["a", "bc"]

    (tmp_path / "wide.txt").write_bytes("caf\u00e9\n".encode("utf-16"))
    with pytest.raises(MalformedRecordError, match=r"wide.txt' is UTF-16 .*iconv -f utf-16 -t utf-8"):
        TokenWindows(files=str(tmp_path / "wide.txt"), length=4).tokens()


def test_bytes_that_are_not_utf8_in_a_plain_file_are_replaced_with_a_warning_naming_it(tmp_path):
    """They became U+FFFD in the training tokens without a word (a JSONL line with them is refused)."""
    from dew.data import TokenWindows
    from dew.data.token_windows import ReplacedBytesWarning

    (tmp_path / "latin.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") + b"\xff\xfe tail\n")
    with pytest.warns(ReplacedBytesWarning, match=r"latin.txt' is not all UTF-8 \(first at byte 3\): 3 bad"):
        read = TokenWindows(files=str(tmp_path / "latin.txt"), length=4).tokens()
    replaced = "caf\ufffd au lait\n\ufffd\ufffd tail\n".encode()  # what the model is given, byte by byte
    assert read.tolist() == [*replaced, 256]  # and the end-of-document id
    (tmp_path / "marked.txt").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "latin.txt").read_bytes())
    with pytest.warns(ReplacedBytesWarning, match=r"marked.txt' is not all UTF-8 \(first at byte 6\)"):
        TokenWindows(files=str(tmp_path / "marked.txt"), length=4).tokens()  # counted from the file's start, BOM and all
    (tmp_path / "fine.txt").write_text("caf\u00e9 \ufffd already there\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TokenWindows(files=str(tmp_path / "fine.txt"), length=4).windows()

def test_a_parquet_column_of_numbers_is_refused_naming_the_row(tmp_path):
    """token_windows failed with AttributeError: 'int' object has no attribute 'encode'."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from dew.data import TokenWindows

    pq.write_table(pa.table({"text": ["a b c", None, "d"], "n": [1, 2, 3]}), tmp_path / "t.parquet")
    assert len(TokenWindows(files=str(tmp_path / "t.parquet"), length=2).windows()) > 0
    with pytest.raises(MalformedRecordError, match=r"Row 1 of .*t.parquet' holds a int under 'n', not a string"):
        TokenWindows(files=str(tmp_path / "t.parquet"), length=2, text_key="n").windows()
    # The streamed reader names the same row as the same row (it counted from 0: "row 0").
    from dew.data.hf_text import HFText

    with pytest.raises(MalformedRecordError, match=r"The text of row 1 of .*t.parquet' is a int"):
        HFText(files=str(tmp_path / "t.parquet"), length=2, text_key="n").records().take(np.arange(1))


def test_a_parquet_or_arrow_file_that_is_no_such_file_is_named_not_blamed_on_the_recipe(tmp_path, capsys):
    """pyarrow's own error named no file, and dew train took it for a refusal of data.load."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from dew.data import TokenWindows
    from dew.data.errors import UnreadableFileError
    from dew.data.hf_text import HFText

    pq.write_table(pa.table({"text": ["a b c d e f"] * 50}), tmp_path / "good.parquet")
    whole = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])  # a copy that stopped
    (tmp_path / "text.arrow").write_text("not arrow at all")
    for name, kind in (("cut.parquet", "Parquet"), ("text.arrow", "Arrow")):
        said = rf"'{tmp_path / name}' cannot be read as a {kind} file \(.+\): it may be cut short"
        with pytest.raises(UnreadableFileError, match=said):
            TokenWindows(files=str(tmp_path / name), length=2).windows()
        with pytest.raises(UnreadableFileError, match=said):
            HFText(files=str(tmp_path / name), length=2).records()
    from dew.cli import main

    overrides = [f"data.files={tmp_path / 'cut.parquet'}", "trainer.steps=1", f"trainer.checkpoint_dir={tmp_path}/run",
                 "trackers=[]"]
    assert main(["train", "tiny-lm", *overrides]) == 2
    err = capsys.readouterr().err
    assert "cut.parquet' cannot be read as a Parquet file" in err and "data.load" not in err, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("[0-9]*"))


def test_a_jsonl_line_that_is_not_utf8_is_named_by_the_streamed_reader(tmp_path):
    """hf_text blamed the recipe's data.load for a UnicodeDecodeError, naming no file or line."""
    from dew.data.hf_text import HFText

    (tmp_path / "u.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    with pytest.raises(MalformedRecordError, match=r"Line 2 of .*u.jsonl' is not UTF-8 text .*byte 0xff"):
        HFText(files=str(tmp_path / "u.jsonl"), length=4).records().take(np.arange(1))


def test_gzip_bzip2_xz_and_zstd_files_are_read_through_their_compression(tmp_path):
    """A .jsonl.gz was refused as 'not UTF-8' (prompt/completion) or 'holds NUL bytes' (token windows);
    gzip, bzip2, xz and zstd (as corpora are published: .jsonl.zst, in several frames) now read as
    the text they hold, named by the format under the compression."""
    import bz2
    import gzip
    import lzma

    import zstandard

    def zstd_frames(data: bytes) -> bytes:  # two frames, as zstd writes a stream it compresses
        half = len(data) // 2
        return zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])

    from dew.data import TokenWindows
    from dew.data.prompt_completion import PromptCompletion

    lines = "".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}", "text": f"doc {i} " * 5}) + "\n"
                    for i in range(6))
    (tmp_path / "plain.jsonl").write_text(lines)
    (tmp_path / "plain.txt").write_text(lines)
    expected_pairs = [pair[1:] for pair in PromptCompletion(files=str(tmp_path / "plain.jsonl")).pairs()]
    expected_windows = TokenWindows(files=str(tmp_path / "plain.jsonl"), length=8).windows()
    for suffix, compress in ((".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress),
                             (".zst", zstd_frames)):
        packed = tmp_path / f"data.jsonl{suffix}"
        packed.write_bytes(compress(lines.encode()))
        assert [pair[1:] for pair in PromptCompletion(files=str(packed)).pairs()] == expected_pairs
        assert np.array_equal(TokenWindows(files=str(packed), length=8).windows(), expected_windows)
    (tmp_path / "doc.txt.gz").write_bytes(gzip.compress(lines.encode()))
    assert np.array_equal(TokenWindows(files=str(tmp_path / "doc.txt.gz"), length=8).windows(),
                          TokenWindows(files=str(tmp_path / "plain.txt"), length=8).windows())


def test_a_zip_file_and_a_compressed_shard_are_refused_with_the_command_that_unpacks_them(tmp_path):
    """A zip holds files, not one stream, and shards are read at any row: both say how to unpack
    the file. A damaged compressed file is named, not left to the decompressor's bare EOFError."""
    import bz2
    import gzip
    import zipfile

    import zstandard

    from dew.data import TokenWindows
    from dew.data.errors import MissingFileError
    from dew.data.hf_text import HFText
    from dew.data.prompt_completion import PromptCompletion

    with zipfile.ZipFile(tmp_path / "d.jsonl.zip", "w") as archive:
        archive.writestr("d.jsonl", '{"text": "a b c"}\n')
    with pytest.raises(MalformedRecordError, match=r"d.jsonl.zip' is zip-compressed.*unzip"):
        TokenWindows(files=str(tmp_path / "d.jsonl.zip"), length=4).windows()
    lines = b"".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}", "text": "doc"}).encode() + b"\n"
                     for i in range(400))
    damaged = ((".gz", gzip.compress(lines)[:-300], "gzip"), (".gz", b"\x1f\x8b" + b"\x07" * 30, "gzip"),
               (".bz2", bz2.compress(lines)[:-300], "bzip2"),
               (".zst", zstandard.ZstdCompressor().compress(lines)[:-300], "zstd"))
    for index, (suffix, packed, name) in enumerate(damaged):
        path = tmp_path / f"cut{index}.jsonl{suffix}"
        path.write_bytes(packed)
        said = rf"cut{index}.jsonl{suffix}' is a damaged {name} file \(.*\): it was cut short or written wrongly"
        with pytest.raises(MalformedRecordError, match=said):
            TokenWindows(files=str(path), length=4).windows()
        with pytest.raises(MalformedRecordError, match=said):
            list(PromptCompletion(files=str(path)).pairs())
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a b c"}\n'))
    with pytest.raises(MissingFileError, match=r"d.jsonl.zst' is compressed.*zstd -d -k"):
        HFText(files=str(tmp_path / "d.jsonl.zst")).shards()
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a b c"}\n'))
    with pytest.raises(MissingFileError, match=r"d.jsonl.gz' is compressed.*gunzip -k"):
        HFText(files=str(tmp_path / "d.jsonl.gz")).shards()


def test_files_of_another_layout_than_the_reader_reads_are_refused_saying_what_to_do(tmp_path):
    """Datasets' own files given to the wrong reader got advice that did not fit: a Parquet file
    'is not UTF-8', a save_to_disk folder wanted a '*.txt' glob, an Arrow file 'holds NUL bytes' (give
    it its suffix: it had it), a JSON array file was 'not valid JSON' or 'holds a list'. And a
    DatasetDict of train_sft and test_sft was answered with the test split's folder."""
    import datasets

    from dew.data import TokenWindows
    from dew.data.chat import Chat
    from dew.data.errors import MissingFileError
    from dew.data.hf_text import HFText
    from dew.data.prompt_completion import PromptCompletion

    records = [{"prompt": f"p{i}", "completion": f"c{i}", "text": f"doc {i}",
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(4)]
    saved = datasets.Dataset.from_list(records)
    saved.to_parquet(str(tmp_path / "pc.parquet"))
    saved.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = sorted((tmp_path / "saved").glob("*.arrow"))
    with pytest.raises(MalformedRecordError, match=r"pc\.parquet' is a Parquet file, and this reader reads JSON "
                       r"Lines .*Dataset\.from_parquet\(path\)\.to_json\('data\.jsonl'\)\), or read it with a "
                       r"reader of shards \(hf_text, chat\)\.$"):
        list(PromptCompletion(files=str(tmp_path / "pc.parquet")).pairs())
    for reader in (lambda f: list(PromptCompletion(files=f).pairs()), lambda f: TokenWindows(files=f).windows()):
        with pytest.raises(MissingFileError, match=r"saved' is a directory, not a file\. It was written by "
                           r"datasets' save_to_disk: read it with hf_text \(files: the folder\) or token_windows "
                           r"\(dataset: the folder\)"):
            reader(str(tmp_path / "saved"))
    (tmp_path / "shards").mkdir()
    for name in ("a.jsonl", "b.jsonl", "notes.md"):
        (tmp_path / "shards" / name).write_text("")
    with pytest.raises(MissingFileError, match=r"Pass existing files or a glob such as '.*shards/\*\.jsonl'"):
        list(PromptCompletion(files=str(tmp_path / "shards")).pairs())
    # an Arrow file reads as its text column, as the same records' JSONL does
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert np.array_equal(TokenWindows(files=str(arrow), length=4).windows(),
                          TokenWindows(files=str(tmp_path / "docs.jsonl"), length=4).windows())

    (tmp_path / "array.json").write_text(json.dumps(records, indent=1))
    (tmp_path / "line.json").write_text(json.dumps(records) + "\n")
    for name in ("array.json", "line.json"):
        file = str(tmp_path / name)
        for read in (lambda f: list(PromptCompletion(files=f).pairs()), lambda f: TokenWindows(files=f).windows(),
                     lambda f: HFText(files=f, length=4).records().take(np.arange(1)),
                     lambda f: Chat(files=f, tokenizer="byte", chat_template="{{ messages }}").rows()):
            with pytest.raises(MalformedRecordError, match=rf"{name}' holds a JSON array, and dew reads JSON Lines: "
                               r"one JSON object per line\. Write each record on a line of its own \(jq -c"):
                read(file)

    half = datasets.Dataset.from_list(records[:2])
    datasets.DatasetDict({"test_sft": half, "train_sft": half}).save_to_disk(str(tmp_path / "ultrachat"))
    with pytest.raises(MissingFileError, match=r"splits \(test_sft, train_sft\).*e\.g\. '.*ultrachat/train_sft'\.$"):
        HFText(files=str(tmp_path / "ultrachat")).shards()


def test_a_null_completion_is_no_text_left_out_with_the_warning_an_empty_one_gets(tmp_path):
    """One null completion refused the whole file, where an empty one is left out with a warning
    (and a null text is no document to token_windows and hf_text)."""
    from dew.data.prompt_completion import NothingToScoreWarning, PromptCompletion

    lines = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}, {"prompt": "e", "completion": "f"}]
    (tmp_path / "null.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "empty.jsonl").write_text("".join(json.dumps({**r, "completion": r["completion"] or ""}) + "\n"
                                                  for r in lines))
    rows = {}
    for name in ("null", "empty"):
        with pytest.warns(NothingToScoreWarning, match=rf"{name}\.jsonl:2 has an empty \(or blank\) completion"):
            rows[name] = PromptCompletion(files=str(tmp_path / f"{name}.jsonl"), tokenizer="byte", length=16).rows()
    assert rows["null"].keys() == rows["empty"].keys()
    for key in rows["null"]:
        assert np.array_equal(rows["null"][key], rows["empty"][key])
