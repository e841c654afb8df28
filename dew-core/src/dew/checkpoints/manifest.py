"""dew's manifest of a step (``dew.json``): its schema, its own digest, and the one way to read it.

The manifest is what every other check trusts (the files' hashes, the leaves'
digests, the data positions), so it is checked first and as strictly: the
bytes must be JSON, the JSON must carry a SHA-256 of its canonical form that
matches, and the content must fit the schema below (types exact, no unknown
fields, base64 that decodes, the step of its own directory). Anything else is
damage, reported as CheckpointCorruptedError naming ``dew.json``, and handled like
any other damaged step. A manifest whose digest matches but which a newer dew
wrote (a later format, or fields this one does not know) is not damage: it is
refused with CheckpointFromNewerDewError, and no older step is taken for it.

Format 1 manifests (written before the manifest had a digest) are read with
the schema checks alone.

>>> body = {"step": 3, "meta": {}, "data": {"shares": 1, "positions": {"0": None}}, "file_hash": "crc32",
...         "leaves": [], "files": {}, "nodes": []}
>>> parse_manifest(render_manifest(body), 3, "3/dew.json").step
3
>>> parse_manifest(b"null", 3, "3/dew.json")
Traceback (most recent call last):
...
dew.checkpoints.errors.CheckpointCorruptedError: Checkpoint step 3 is corrupt: 3/dew.json: dew's manifest is not a JSON object (it holds null).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dew.checkpoints.errors import CheckpointCorruptedError, CheckpointFromNewerDewError
from dew.versions import writer

__all__ = ["FORMAT", "Manifest", "parse_manifest", "render_manifest"]

FORMAT = 2
_U32 = Annotated[int, Field(ge=0, lt=2**32)]
_COUNT = Annotated[int, Field(ge=0)]
_SHA256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
_HEX_LENGTH = {"crc32": 8, "sha256": 64}


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Leaf(_Record):
    """One saved array: its tree path, shape, dtype and dew's 32-bit digest of its contents."""

    path: str
    shape: list[_COUNT]
    dtype: str
    digest: _U32


class Node(_Record):
    """One interior node of the saved tree: its path, type name and number of children."""

    path: str
    type: str
    children: _COUNT


class Positions(_Record):
    """Every data share's saved position, base64 (None where the iterator had no state)."""

    shares: Annotated[int, Field(ge=1)]
    positions: dict[str, str | None]

    @field_validator("positions")
    @classmethod
    def _decodable(cls, positions: dict[str, str | None]) -> dict[str, str | None]:
        for share, text in positions.items():
            if not share.isdigit() or not share.isascii():
                raise ValueError(f"share {share!r} is not a share number")
            if text is not None:
                try:
                    base64.b64decode(text, validate=True)
                except (binascii.Error, ValueError):
                    raise ValueError(f"the position of share {share} is not valid base64") from None
        return positions

    def decoded(self) -> dict[int, bytes | None]:
        """The positions as bytes, by share number."""
        return {int(share): None if text is None else base64.b64decode(text, validate=True)
                for share, text in self.positions.items()}


class Manifest(_Record):
    """A validated dew.json."""

    format: Literal[1, 2]
    step: _COUNT
    meta: dict[str, Any]
    data: Positions
    leaves: list[Leaf]
    file_hash: Literal["crc32", "sha256"] = "sha256"
    files: dict[str, list[Any]]
    nodes: list[Node] | None = None
    digest: _SHA256 | None = None

    @model_validator(mode="after")
    def _sized_and_hashed(self) -> Manifest:
        width = _HEX_LENGTH[self.file_hash]
        for name, entry in self.files.items():
            if (len(entry) != 2 or type(entry[0]) is not int or entry[0] < 0 or type(entry[1]) is not str
                    or len(entry[1]) != width or any(c not in "0123456789abcdef" for c in entry[1])):
                raise ValueError(f"the entry of file {name!r} is not [size, {self.file_hash}]")
            if name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"file {name!r} is outside the step's directory")
        return self


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def render_manifest(body: dict[str, Any]) -> bytes:
    """The bytes of a manifest holding body (without format and digest), its digest added."""
    body = {**body, "format": FORMAT}
    return _canonical({**body, "digest": hashlib.sha256(_canonical(body)).hexdigest()})


def _shown(value: Any) -> str:
    text = json.dumps(value)[:60] if value is None or isinstance(value, bool | int | float | str) else type(
        value).__name__
    return text


def parse_manifest(raw: bytes, step: int, file: object) -> Manifest:
    """Check and read the manifest bytes of step; CheckpointCorruptedError(step, file, why) when damaged."""

    def damaged(reason: str) -> CheckpointCorruptedError:
        return CheckpointCorruptedError(step, file, f"dew's manifest {reason}")

    try:
        document = json.loads(raw)
    except RecursionError:
        raise damaged("is nested too deeply to be dew's") from None
    except (ValueError, TypeError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise damaged(f"is not valid JSON ({str(error)[:200]})") from None
    if not isinstance(document, dict):
        raise damaged(f"is not a JSON object (it holds {_shown(document)})")
    written = document.get("format")
    if written != 1 or "digest" in document:
        claimed = document.pop("digest", None)
        if not isinstance(claimed, str):
            raise damaged("has no digest of its own")
        try:
            actual = hashlib.sha256(_canonical(document)).hexdigest()
        except (ValueError, TypeError, RecursionError):
            raise damaged("cannot be put in canonical form") from None
        if actual != claimed:
            raise damaged("does not match its own digest (it was altered after it was written)")
        document["digest"] = claimed
        if type(written) is int and written > FORMAT:  # whole, in a layout still to come
            raise CheckpointFromNewerDewError(step, file, f"has checkpoint format {written} (this dew reads "
                                                          f"formats 1 to {FORMAT})", writer(document.get("meta")))
    try:
        manifest = Manifest.model_validate(document)
    except ValidationError as error:
        unknown = sorted(".".join(map(str, e["loc"])) for e in error.errors() if e["type"] == "extra_forbidden")
        if "digest" in document and len(unknown) == error.error_count():  # whole, with fields to come
            raise CheckpointFromNewerDewError(step, file, f"holds field{'s' if len(unknown) > 1 else ''} "
                                                          f"{', '.join(unknown)}", writer(document.get("meta"))) from None
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the top level"
        raise damaged(f"is malformed at {where}: {first['msg']}") from None
    except (RecursionError, ValueError, TypeError) as error:
        raise damaged(f"is malformed ({str(error)[:200]})") from None
    if manifest.step != step:
        raise damaged(f"describes step {manifest.step}, not the step of its directory")
    if manifest.format == 2 and (manifest.nodes is None or "file_hash" not in document):
        raise damaged(f"is malformed at {'nodes' if manifest.nodes is None else 'file_hash'}: Field required")
    return manifest

