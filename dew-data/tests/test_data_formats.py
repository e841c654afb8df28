"""Text files as editors and tools write them: a byte-order mark, a column of numbers, bytes that are
not UTF-8. Each is read as the text it holds or refused naming the file, the line or row, and the fix."""

from __future__ import annotations

import json

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


def test_a_parquet_column_of_numbers_is_refused_naming_the_row(tmp_path):
    """token_windows failed with AttributeError: 'int' object has no attribute 'encode'."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from dew.data import TokenWindows

    pq.write_table(pa.table({"text": ["a b c", None, "d"], "n": [1, 2, 3]}), tmp_path / "t.parquet")
    assert len(TokenWindows(files=str(tmp_path / "t.parquet"), length=2).windows()) > 0
    with pytest.raises(MalformedRecordError, match=r"Row 1 of .*t.parquet' holds a int under 'n', not a string"):
        TokenWindows(files=str(tmp_path / "t.parquet"), length=2, text_key="n").windows()


def test_a_jsonl_line_that_is_not_utf8_is_named_by_the_streamed_reader(tmp_path):
    """hf_text blamed the recipe's data.load for a UnicodeDecodeError, naming no file or line."""
    from dew.data.hf_text import HFText

    (tmp_path / "u.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    with pytest.raises(MalformedRecordError, match=r"Line 2 of .*u.jsonl' is not UTF-8 text .*byte 0xff"):
        HFText(files=str(tmp_path / "u.jsonl"), length=4).records().take(np.arange(1))
