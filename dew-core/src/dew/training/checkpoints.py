"""Checkpoints: a run's saved TrainStates, one directory, written by Orbax in the background.

A step directory holds the state (Orbax, OCDBT) and dew's manifest
(``dew.json``): the caller's meta, every share's data position, each leaf's
path, shape, dtype and digest, and each file's size and SHA-256. The manifest
is written into the temporary directory just before Orbax renames it, so a
step is either committed whole or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew.data.base import DataPartition
from dew.training import checkpoint_integrity as integrity
from dew.training.checkpoint_errors import (
    CheckpointCorrupted,
    CheckpointNotFound,
    CheckpointTreeMismatch,
    CheckpointWriteError,
)
from dew.training.checkpoint_pool import barrier, gather_positions, probe_shared_directory
from dew.training.checkpoint_store import (
    TMP,
    Store,
    absolute,
    read_position,
    remove_half_written,
    rmtree,
)
from dew.training.state import TrainState

__all__ = ["Checkpoints", "Restored"]

_LOG = logging.getLogger("dew.checkpoints")
_CORRUPT = ".dew-corrupt"
_FORMAT = 1


@dataclass(frozen=True)
class Restored:
    """A restored step: its state (placed as the template asked), data position and meta."""

    step: int
    state: TrainState
    position: bytes | None
    meta: dict[str, Any]


@dataclass
class _Pending:
    step: int
    leaves: list[dict[str, Any]]
    positions: dict[str, Any]
    meta: dict[str, Any]
    digests: jax.Array | None = None
    dispatched: threading.Event = field(default_factory=threading.Event)


class Checkpoints:
    """Hold the checkpoints of one run, in one directory.

    save() returns once the arrays are copied off the device; Orbax writes
    them in the background, and a failure of that write is raised by the
    next save() or wait(), naming the step and the directory. keep bounds
    how many committed steps stay on disk (None keeps all); older ones are
    deleted only after a newer one is committed.

    Every restore checks the step against its manifest: the files' hashes
    before reading, the leaves' digests after. A damaged step raises
    CheckpointCorrupted naming the step, the file and the newest older good
    step; with fallback=True (the default, so an unattended restart keeps
    going) restore warns on stderr, moves the damaged step aside to
    ``<step>.dew-corrupt`` and continues from that older step instead.

    local_directory (one per host) receives the saves the trainer marks
    local, every local_every steps; restore prefers a local step when it is
    newer than the persistent one. Local checkpoints are for a lone process.

    In a pool every process calls every method in the same order; each writes
    its own shards and process 0 commits. On first use process 0 writes a
    probe file that every process must see (skipped for gs:// buckets).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        local_directory: str | os.PathLike | None = None,
        local_every: int | None = None,
        fallback: bool = True,
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"Checkpoints(keep=...) must be at least 1 or None (keep all), got {keep}.")
        if local_every is not None and local_every < 1:
            raise ValueError(f"Checkpoints(local_every=...) must be at least 1 or None, got {local_every}.")
        if local_every is not None and local_directory is None:
            raise ValueError("Checkpoints(local_every=...) needs a local_directory to write into.")
        self.directory = absolute(directory)
        self.keep = keep
        self.local_directory = None if local_directory is None else absolute(local_directory)
        self.local_every = local_every
        self.fallback = fallback
        self._persistent = Store(self.directory, local=False)
        self._local = None if self.local_directory is None else Store(self.local_directory, local=True)
        self._ready = False

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, keep={self.keep})"

    # -- setup ----------------------------------------------------------------

    @property
    def _stores(self) -> list[Store]:
        return [self._persistent] + ([self._local] if self._local is not None else [])

    def _setup(self) -> None:
        if self._ready:
            return
        if self._local is not None and jax.process_count() > 1:
            raise ValueError(
                "Local emergency checkpoints (local_directory) are supported for a lone process only; "
                "drop local_directory when training in a pool."
            )
        probe_shared_directory(self.directory)
        for store in self._stores:
            if jax.process_index() == 0:
                store.directory.mkdir(parents=True, exist_ok=True)
                remove_half_written(store.directory)
            barrier(f"dew-checkpoints-clean-{store.local}")
            store.manager = ocp.CheckpointManager(
                store.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=None,  # dew prunes, only after the newer step committed
                    create=True,
                    enable_async_checkpointing=True,
                    cleanup_tmp_directories=False,
                    async_options=ocp.AsyncOptions(
                        post_finalization_callback=lambda store=store: self._write_manifest(store)
                    ),
                ),
            )
        self._ready = True

    # -- queries --------------------------------------------------------------

    @property
    def latest(self) -> int | None:
        """The newest committed step, persistent or local (None when there is none)."""
        self._setup()
        self._settle()
        steps = [step for store in self._stores for step in store.committed()]
        return max(steps, default=None)

    def path(self, step: int) -> Path:
        """The directory of step (the persistent one unless only the local store holds it)."""
        if self._local is not None and not self._persistent.step_path(step).exists() \
                and self._local.step_path(step).exists():
            return self._local.step_path(step)
        return self._persistent.step_path(step)

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest dew wrote with step: its meta, data positions, leaf digests and file hashes."""
        store = next((s for s in reversed(self._stores) if step in s.committed()), self._persistent)
        return self._manifest(store, int(step))

    # -- saving ---------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        position: bytes | None,
        partition: DataPartition,
        meta: Mapping[str, Any],
        local: bool = False,
    ) -> None:
        """Start writing state, this process's data position and meta as step.

        Blocks for the copy of the arrays off the device (and for the previous
        save, if it is still writing). A step already committed is not written
        again. meta must be JSON-serializable.
        """
        step = int(step)
        self._setup()
        store = self._local if local else self._persistent
        if store is None:
            raise ValueError("save(..., local=True) needs Checkpoints(local_directory=...).")
        try:
            meta = json.loads(json.dumps(dict(meta)))
        except TypeError as error:
            raise TypeError(f"Checkpoint meta must be JSON-serializable: {error}. Pass plain numbers, "
                            "strings, lists and dicts.") from error
        self._settle()
        if step in store.committed():
            _LOG.info("Checkpoint step %s is already in %s; not written again.", step, store.directory)
            return
        pending = _Pending(
            step=step,
            leaves=integrity.leaf_table(state),
            positions=gather_positions(position, partition),
            meta=meta,
        )
        with store.lock:
            store.pending = pending
        try:
            store.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
        except Exception as error:
            store.pending = None
            raise CheckpointWriteError(step, store.directory, error) from error
        finally:
            # Dispatched after Orbax's copy, so the two do not compete; the arrays are
            # still alive here (the caller has not donated them to the next step yet).
            try:
                pending.digests = integrity.digest_leaves(jax.tree_util.tree_leaves(state))
            finally:
                pending.dispatched.set()

    def _write_manifest(self, store: Store) -> None:
        """Orbax's last call before the commit (process 0 only): record what was written."""
        with store.lock:
            pending = store.pending
        if pending is None:
            raise RuntimeError("dew's checkpoint manifest callback ran without a pending save.")
        temporary = store.directory / f"{pending.step}{TMP}"
        if not pending.dispatched.wait(timeout=600) or pending.digests is None:
            raise RuntimeError(f"the leaf digests of step {pending.step} were never computed")
        manifest = {
            "format": _FORMAT,
            "step": pending.step,
            "meta": pending.meta,
            "data": pending.positions,
            "leaves": [
                {**leaf, "digest": digest}
                for leaf, digest in zip(pending.leaves, integrity.digests_as_lists(pending.digests), strict=True)
            ],
            "files": integrity.file_table(temporary),
        }
        target = temporary / integrity.MANIFEST
        with target.open("w") as handle:
            json.dump(manifest, handle)
            if hasattr(handle, "fileno"):
                handle.flush()
                os.fsync(handle.fileno())

    def _settle(self) -> None:
        """Wait for pending saves; raise the first failure; apply retention."""
        failures: list[CheckpointWriteError] = []
        for store in self._stores:
            pending = store.pending
            if store.manager is None:
                continue
            try:
                try:
                    store.manager.wait_until_finished()
                finally:
                    store.pending = None
                if pending is not None and pending.step not in store.committed():
                    raise RuntimeError("Orbax finished without committing the step")
            except Exception as error:
                if pending is None:
                    raise
                failure = CheckpointWriteError(pending.step, store.directory, error)
                failure.__cause__ = error
                failures.append(failure)
                continue
            if pending is not None:
                self._prune(store)
        if failures:
            raise failures[0]

    def _prune(self, store: Store) -> None:
        if self.keep is None:
            return
        if jax.process_index() == 0:
            for step in store.committed()[: -self.keep]:
                rmtree(store.step_path(step))
        barrier(f"dew-checkpoints-pruned-{store.local}")
        store.manager.reload()

    def wait(self) -> None:
        """Block until every pending save is committed; raise a failed save's error."""
        if self._ready:
            self._settle()

    def close(self) -> None:
        """Wait for pending saves, then release Orbax's resources."""
        try:
            self.wait()
        finally:
            for store in self._stores:
                if store.manager is not None:
                    store.manager.close()
                    store.manager = None
            self._ready = False

    # -- restoring ------------------------------------------------------------

    def restore(self, template: TrainState, *, partition: DataPartition, step: int | None = None) -> Restored:
        """Restore step (default: the newest) into the shardings of template's leaves.

        template is a TrainState of jax.ShapeDtypeStruct leaves, each with a
        sharding. Raises CheckpointTreeMismatch, PositionShareMismatch or
        CheckpointCorrupted (see the class docstring for fallback).
        """
        self._setup()
        self._settle()
        candidates = self._candidates(step)
        expected = integrity.leaf_table(template)
        for index, (store, number) in enumerate(candidates):
            try:
                return self._restore_one(store, number, template, expected, partition)
            except CheckpointCorrupted as error:
                older = candidates[index + 1:]
                good = self._newest_good(older)
                error = error.with_good(None if good is None else good[1])
                if step is not None or not self.fallback or good is None:
                    raise error from None
                message = f"dew: {error} Restoring step {good[1]} instead."
                print(message, file=sys.stderr, flush=True)
                _LOG.warning(message)
                self._quarantine(store, number)
        raise CheckpointNotFound(f"No checkpoint to restore in {self.directory}.")  # pragma: no cover

    def _candidates(self, step: int | None) -> list[tuple[Store, int]]:
        found = [(store, number) for store in reversed(self._stores) for number in store.committed()]
        if step is not None:
            found = [(store, number) for store, number in found if number == step]
            if not found:
                raise CheckpointNotFound(
                    f"Checkpoint step {step} is not in {self.directory}; it holds steps "
                    f"{sorted({n for s in self._stores for n in s.committed()})}."
                )
            return found[-1:]  # the persistent copy when both hold it
        if not found:
            raise CheckpointNotFound(
                f"{self.directory} holds no committed checkpoint; check .latest before restoring."
            )
        # Newest first; on a tie the persistent copy (listed last) wins.
        order = {id(self._persistent): 0, id(self._local): 1}
        return sorted(found, key=lambda item: (-item[1], order[id(item[0])]))

    def _manifest(self, store: Store, step: int) -> dict[str, Any]:
        path = store.step_path(step) / integrity.MANIFEST
        try:
            with path.open() as handle:
                return json.load(handle)
        except FileNotFoundError:
            raise CheckpointCorrupted(step, path, "dew's manifest is missing") from None
        except (OSError, ValueError) as error:
            raise CheckpointCorrupted(step, path, f"dew's manifest cannot be read ({error})") from None

    def _check_files(self, store: Store, step: int) -> dict[str, Any]:
        manifest = self._manifest(store, step)
        problem = integrity.verify_files(store.step_path(step), manifest["files"])
        if problem is not None:
            raise CheckpointCorrupted(step, *problem)
        return manifest

    def _newest_good(self, candidates: list[tuple[Store, int]]) -> tuple[Store, int] | None:
        for store, number in candidates:
            try:
                self._check_files(store, number)
            except CheckpointCorrupted:
                continue
            return store, number
        return None

    def _restore_one(self, store: Store, step: int, template: TrainState, expected: list[dict[str, Any]],
                     partition: DataPartition) -> Restored:
        manifest = self._manifest(store, step)
        differences = integrity.compare_leaves(manifest["leaves"], expected)
        if differences:
            raise CheckpointTreeMismatch(step, differences)
        position = read_position(step, manifest["data"], partition)
        self._check_files(store, step)
        try:
            restored = store.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template))
            ).state
        except Exception as error:  # Orbax raises bare exceptions for damaged data
            raise CheckpointCorrupted(step, store.step_path(step) / "state", f"Orbax cannot read it ({error})") from error
        digests = integrity.digests_as_lists(integrity.digest_leaves(jax.tree_util.tree_leaves(restored)))
        for leaf, digest in zip(manifest["leaves"], digests, strict=True):
            if leaf["digest"] != digest:
                raise CheckpointCorrupted(
                    step, store.step_path(step) / "state", f"leaf {leaf['path']} does not match its digest"
                )
        return Restored(step=step, state=restored, position=position, meta=dict(manifest["meta"]))

    def _quarantine(self, store: Store, step: int) -> None:
        if jax.process_index() == 0:
            source = store.step_path(step)
            target = store.directory / f"{step}{_CORRUPT}"
            if target.exists():
                rmtree(target)
            source.rename(target)
        barrier(f"dew-checkpoints-quarantine-{step}")
        store.manager.reload()
