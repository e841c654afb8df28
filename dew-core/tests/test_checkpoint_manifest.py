"""The manifest (dew.json) is checked like the arrays: a schema, a digest of its own, damage named and skipped."""

from __future__ import annotations

import base64
import gc
import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dew.checkpoints.errors import CheckpointCorruptedError, CheckpointFromNewerDewError
from dew.checkpoints.manager import Checkpoints
from dew.checkpoints.manifest import Manifest, parse_manifest, render_manifest
from test_checkpoints import (  # every test folder is on sys.path (conftest.py)
    SINGLE,
    assert_same,
    full_state,
    reseal,
    save,
    template_of,
)


def _flip_position_bit(path: Path) -> None:
    """Flip one bit of one character of the saved data position, in place."""
    raw = path.read_bytes()
    encoded = base64.b64encode(b"p3").decode()
    at = raw.index(encoded.encode()) + 1
    path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:])


def _invalid_base64(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["data"]["positions"]["0"] = "@@not base64@@"
    path.write_bytes(reseal(manifest))  # its own digest agrees: the schema must catch it


def _another_steps(path: Path) -> None:
    shutil.copy(path.parent.parent / "1" / "dew.json", path)


def _wrong_type(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["leaves"][0]["shape"] = "16x16"
    path.write_bytes(reseal(manifest))


def _without_digest(path: Path) -> None:
    manifest = json.loads(path.read_text())
    del manifest["digest"]
    path.write_text(json.dumps(manifest))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty": (lambda path: path.write_bytes(b""), "is not valid JSON"),
    "null": (lambda path: path.write_text("null"), "is not a JSON object (it holds null)"),
    "garbled": (lambda path: path.write_bytes(b"\xff\xfe{garbage"), "is not valid JSON"),
    "position-bit": (_flip_position_bit, "does not match its own digest"),
    "invalid-base64": (_invalid_base64, "the position of share 0 is not valid base64"),
    "another-step": (_another_steps, "describes step 1, not the step of its directory"),
    "wrong-type": (_wrong_type, "is malformed at leaves.0.shape"),
    "no-digest": (_without_digest, "has no digest of its own"),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_manifest_is_named_and_skipped(tmp_path: Path, how: str, capsys: pytest.CaptureFixture) -> None:
    checkpoints = Checkpoints(tmp_path, keep=None)
    for step in (1, 2, 3):
        save(checkpoints, step, full_state(step), f"p{step}".encode())
    checkpoints.close()
    damage, reason = DAMAGE[how]
    damage(tmp_path / "3" / "dew.json")
    if how == "another-step":  # step 2 holds step 1's manifest: the newest good step is 1
        damage(tmp_path / "2" / "dew.json")

    good = 1 if how == "another-step" else 2
    with pytest.raises(CheckpointCorruptedError) as caught:
        Checkpoints(tmp_path, fallback=False).restore(template_of(full_state()), partition=SINGLE)
    assert caught.value.step == 3 and caught.value.file == str(tmp_path / "3" / "dew.json")
    assert reason in str(caught.value) and f"newest older good step is {good}" in str(caught.value)
    with pytest.raises(CheckpointCorruptedError, match=re.escape(reason)):
        Checkpoints(tmp_path).meta(3)

    restored = Checkpoints(tmp_path).restore(template_of(full_state()), partition=SINGLE)
    assert (restored.step, restored.position) == (good, f"p{good}".encode())
    assert_same(restored.state, full_state(good))
    assert "step 3 is corrupt" in capsys.readouterr().err
    assert (tmp_path / "3.dew-corrupt").is_dir()


def _later_format(document: dict) -> None:
    document["format"] = 3
    document["meta"]["dew"] = {"dew-core": "9.0.0"}  # what a trainer's save records of its writer


def _unknown_field(document: dict) -> None:
    document["writer"] = "dew-core 9.0"
    document["leaves"][0]["chunks"] = [1, 1]


@pytest.mark.parametrize("change", [_later_format, _unknown_field])
def test_a_step_a_newer_dew_wrote_whole_is_refused_as_such_and_not_set_aside(tmp_path: Path, change) -> None:
    checkpoints = Checkpoints(tmp_path, keep=None)
    for step in (1, 2):
        save(checkpoints, step, full_state(step), f"p{step}".encode())
    checkpoints.close()
    path = tmp_path / "2" / "dew.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest.pop("digest")
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    manifest["digest"] = hashlib.sha256(canonical).hexdigest()  # whole, as the newer dew wrote it
    path.write_text(json.dumps(manifest))
    before = sorted(p.name for p in tmp_path.iterdir())

    with pytest.raises(CheckpointFromNewerDewError) as caught:  # fallback on: still not taken
        Checkpoints(tmp_path).restore(template_of(full_state()), partition=SINGLE)
    assert caught.value.step == 2 and str(path) in str(caught.value) and "Upgrade dew" in str(caught.value)
    wanted = ["newer dew (dew-core 9.0.0)", "format 3"] if change is _later_format else ["fields leaves.0.chunks, writer"]
    assert all(part in str(caught.value) for part in wanted), str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing set aside, nothing removed
    assert json.loads(path.read_text()) == manifest


VALID = {
    "step": 7,
    "meta": {"accumulation": 2, "scaler": None},
    "data": {"shares": 2, "positions": {"0": base64.b64encode(b"\x00\x01").decode(), "1": None}},
    "leaves": [{"path": ".params['w']", "shape": [3, 4], "dtype": "float32", "digest": 123456}],
    "nodes": [{"path": "<root>", "type": "TrainState", "children": 9}],
    "file_hash": "crc32",
    "files": {"state/d/abc": [12, "0123abcd"]},
}


def test_a_valid_manifest_reads_back() -> None:
    manifest = parse_manifest(render_manifest(VALID), 7, "7/dew.json")
    assert isinstance(manifest, Manifest) and manifest.format == 2
    assert manifest.data.decoded() == {0: b"\x00\x01", 1: None}
    assert manifest.leaves[0].shape == [3, 4] and manifest.files["state/d/abc"] == [12, "0123abcd"]


def _parse_in_time(raw: bytes) -> None:
    """Every input gives a Manifest or CheckpointCorruptedError (or, sealed by its digest, a newer
    dew's layout), within a second of this thread's CPU (wall time would count the machine's load; a
    garbage collection of the whole worker's heap, which once took 1.7 s here, is not the parse's)."""
    gc.disable()
    began = time.thread_time()
    try:
        result = parse_manifest(raw, 7, "7/dew.json")
    except CheckpointCorruptedError as error:
        assert error.step == 7 and "dew's manifest" in error.reason
    except CheckpointFromNewerDewError as error:
        assert error.step == 7 and "digest" in json.loads(raw)
    else:
        assert isinstance(result, Manifest) and result.step == 7
    finally:
        spent = time.thread_time() - began
        gc.enable()
    assert spent < 1.0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=2000))
def test_fuzz_arbitrary_bytes(raw: bytes) -> None:
    _parse_in_time(raw)


@pytest.mark.slow
@FUZZ
@given(JSON)
def test_fuzz_arbitrary_json(document: object) -> None:
    _parse_in_time(json.dumps(document).encode())


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*prefix, index))
    return found


@FUZZ
@given(st.data(), JSON, st.booleans())
def test_fuzz_a_valid_manifest_with_one_part_replaced(data: st.DataObject, replacement: object,
                                                      sealed: bool) -> None:
    """Replace any part of a valid manifest by any JSON, resealed (schema's turn) or not (digest's turn)."""
    document = json.loads(render_manifest(VALID))
    path = data.draw(st.sampled_from([p for p in _paths(document) if p]))
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = replacement
    raw = reseal(document) if sealed else json.dumps(document).encode()
    _parse_in_time(raw)


@FUZZ
@given(st.binary(min_size=1, max_size=1), st.integers(min_value=0))
def test_fuzz_one_byte_of_a_valid_manifest(byte: bytes, where: int) -> None:
    raw = bytearray(render_manifest(VALID))
    raw[where % len(raw)] = byte[0]
    _parse_in_time(bytes(raw))


@pytest.mark.parametrize("raw", [b"[" * 200_000, b'{"a":' * 200_000, b"9" * 100_000, b'"\\ud800"', b"1e999999"])
def test_pathological_manifests_are_refused_quickly(raw: bytes) -> None:
    with pytest.raises(CheckpointCorruptedError):
        parse_manifest(raw, 7, "7/dew.json")
    _parse_in_time(raw)
