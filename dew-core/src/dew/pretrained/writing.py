"""Writing a model directory whole: into a fresh directory beside OUT, then swapped in.

``replacing(out)`` yields a new empty directory next to OUT; what is written
there becomes OUT in one step (an atomic exchange of the two names where
the system has one, else two renames), and the previous OUT is removed.
A kill at any moment leaves the previous export or the new one whole, and
nothing of an earlier export (a stale index, a shard) survives into the new
one, since the new one never shared its directory. The fresh directory's
name carries a digest of OUT's name and its writer's process and machine
(``.dew-writing-<out>-<pid>@<host>-...``, short whatever OUT's name), so a
later write beside OUT removes what a killed writer of this machine left there.

OUT must be new, empty, or an export dew wrote (its config.json carries
dew's record, or its adapter weights dew's base digest), holding only the
files an export writes. Anything else is someone else's and is refused,
naming it, unless ``force``: then those other entries are moved into the
new export as they are (a symbolic link stays a link; nothing is written
through one), and only the files the export writes are replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from dew.pretrained.errors import PretrainedError

__all__ = ["WRITTEN_NAMES", "ExportDirectoryError", "ExportWriteError", "check_out", "foreign_entries", "fresh_beside",
           "process_umask", "replacing", "swap_in"]

# What an export writes (besides the shards model-NNNNN-of-NNNNN.safetensors).
WRITTEN_NAMES = frozenset({
    "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "added_tokens.json", "generation_config.json", "verification.json", "adapter_config.json",
    "adapter_model.safetensors",
})


class ExportDirectoryError(PretrainedError):
    """OUT cannot take an export: it is a file or a link, or it holds files dew did not write."""


class ExportWriteError(PretrainedError):
    """Writing an export failed part way (a full disk, a quota, a file-size limit); OUT is as it was."""


def _write_failure(error: BaseException) -> str | None:
    """Why writing failed, when error is the system refusing a write (safetensors and tokenizers,
    written in Rust, report it as an error of their own or a plain Exception, with the system's
    words and "os error N"); None for anything else."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    if type(error).__name__ in ("SafetensorError", "Exception") and "os error" in str(error).lower():
        return str(error)
    return None


def _written_name(name: str) -> bool:
    return name in WRITTEN_NAMES or (name.startswith("model-") and name.endswith(".safetensors"))


def _dews(out: Path) -> bool:
    """Whether out holds an export dew wrote: its config.json's record, or its adapters' digest."""
    config = out / "config.json"
    if config.is_file() and not config.is_symlink():
        try:
            if config.stat().st_size < 2**24:
                read = json.loads(config.read_text())
                if isinstance(read, dict) and ("dew" in read or read.get("format") == "dew"):
                    return True
        except (OSError, ValueError):
            pass
    adapters = out / "adapter_model.safetensors"
    if adapters.is_file() and not adapters.is_symlink():
        try:
            from safetensors import safe_open

            from dew.pretrained.peft import DIGEST_KEY

            with safe_open(str(adapters), framework="numpy") as handle:
                return DIGEST_KEY in (handle.metadata() or {})
        except Exception:  # noqa: BLE001 - unreadable weights are not dew's record
            return False
    return False


def foreign_entries(out: Path) -> list[str]:
    """The entries of out that an export of dew's did not write (all of them, if none did)."""
    entries = sorted(os.listdir(out))
    if not entries:
        return []
    if not _dews(out):
        return entries
    return [name for name in entries if not _written_name(name) or (out / name).is_symlink()
            or not (out / name).is_file()]


def check_out(out: Path, *, force: bool = False) -> list[str]:
    """Refuse an OUT that is a file or a link, or holds others' files (unless force); return those."""
    if out.is_symlink():
        raise ExportDirectoryError(
            f"{out} is a symbolic link; dew writes an export only into a real directory. Give the "
            "directory it points to, or a new path.")
    if out.exists() and not out.is_dir():
        raise ExportDirectoryError(
            f"{out} is a file, not a directory; give a new or empty directory as OUT (or remove "
            "the file first).")
    if not out.exists():
        return []
    foreign = foreign_entries(out)
    if foreign and not force:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ExportDirectoryError(
            f"{out} holds files dew did not write ({shown}); an export there would overwrite or "
            "mix with them. Give a new or empty directory, or pass --force (force=True) to "
            "replace the export's own files and keep the others.")
    return foreign


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names a and b in one step (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    done = call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0


def fresh_beside(out: Path) -> Path:
    """A new empty directory beside out (whose folder exists), to write what is to replace it;
    first removes those that writers of this machine no longer running left beside out."""
    _sweep(out)
    return Path(tempfile.mkdtemp(prefix=_prefix(out, "writing"), dir=out.parent))


def _short(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def _prefix(out: Path, kind: str) -> str:
    """The name a fresh (kind "writing") or previous-content ("old") directory beside out starts with."""
    return f".dew-{kind}-{_short(out.name)}-{os.getpid()}@{_short(socket.gethostname())}-"


def _sweep(out: Path) -> None:
    """Remove the fresh and previous-content directories beside out whose writer, a process of
    this machine, has ended (killed part way: its directories were never swapped in or removed)."""
    left = re.compile(rf"\.dew-(?:writing|old)-{_short(out.name)}-(\d+)@([0-9a-f]{{8}})-[^-]+")
    host = _short(socket.gethostname())
    try:
        entries = list(out.parent.iterdir())
    except OSError:  # nothing to sweep where nothing can be listed
        return
    for entry in entries:
        found = left.fullmatch(entry.name)
        if found and found[2] == host and not _running(int(found[1])) and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def swap_in(fresh: Path, out: Path, carry: Sequence[str] = ()) -> None:
    """Make fresh out, the entries of out named in carry moved into it first, and remove out's
    previous content: in one exchange of the two names where the system has one."""
    for name in carry:  # entries of others' travel into the new directory as they are
        if not (fresh / name).exists() and not (fresh / name).is_symlink():
            os.rename(out / name, fresh / name)
    os.chmod(fresh, 0o777 & ~process_umask())
    if not out.exists():
        os.rename(fresh, out)
        return
    if not _exchange(fresh, out):
        old = Path(tempfile.mkdtemp(prefix=_prefix(out, "old"), dir=out.parent))
        os.rename(out, old / "out")
        os.rename(fresh, out)
        fresh = old
    shutil.rmtree(fresh, ignore_errors=True)  # the previous content (rmtree never follows a link)


@contextlib.contextmanager
def replacing(out: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """A fresh directory to write an export into; on success it becomes out (see the module).

    On an error the fresh directory is removed and out is left as it was.
    """
    out = Path(out).absolute()
    foreign = check_out(out, force=force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file where a folder above OUT should be, or a read-only parent
        raise ExportDirectoryError(
            f"{out}'s folder {out.parent} cannot be made ({error.strerror or error}); a folder above OUT "
            "is a file or cannot be written. Give an OUT whose folders exist or can be created.") from None
    try:
        fresh = fresh_beside(out)
    except OSError as error:
        raise ExportDirectoryError(
            f"{out.parent} cannot be written ({error.strerror or error}), so no export can be made in it "
            "as OUT. Give an OUT in a directory this process can write.") from None
    try:
        yield fresh
        swap_in(fresh, out, [name for name in foreign if not _written_name(name)])
    except BaseException as error:
        shutil.rmtree(fresh, ignore_errors=True)
        reason = _write_failure(error)
        if reason is None:
            raise
        kept = f"{out} is as it was" if out.exists() else "nothing was left behind"
        raise ExportWriteError(
            f"Writing the export to {out} failed ({reason}); {kept}. Free space on the disk that holds "
            f"{out.parent} (or raise the file-size limit or quota), or give an OUT on another disk.") from None


def process_umask() -> int:
    """The process's file-mode creation mask (read by setting it and setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
