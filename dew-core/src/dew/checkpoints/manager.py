"""Checkpoints: a run's saved TrainStates, one directory, written by Orbax in the background.

A step directory holds the state (Orbax, OCDBT) and dew's manifest
(``dew.json``): the caller's meta, every share's data position, each leaf's
path, shape, dtype and digest, and each file's size and checksum. The manifest
is written into the temporary directory just before Orbax renames it, so a
step is either committed whole or not at all.

Readers and the writer. Reading (``latest``, ``path``, ``meta``, ``restore``)
changes nothing on disk, so any number of processes may watch a live run
(restore's fallback alone sets a damaged step aside, when no live writer holds
the directory).
The first ``save`` (or an explicit ``acquire``) makes the object the
directory's writer: it takes the writer's lease (see checkpoint_lease), and
only then removes the half-written steps a crashed writer left. A second
process that tries to write is refused, naming the holder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew.checkpoints import integrity, lease, owner
from dew.checkpoints.errors import (
    CheckpointCorruptedError,
    CheckpointLeaseHeldError,
    CheckpointNotFoundError,
    CheckpointRemovedWarning,
    CheckpointWriteError,
)
from dew.checkpoints.local import (
    PLACEMENT,
    LocalPlacementMismatchError,
    all_agree,
    local_manager,
    placement_of,
    process_directory,
)
from dew.checkpoints.manifest import Manifest, render_manifest
from dew.checkpoints.pool import barrier, gather_positions, pooled, probe_shared_directory
from dew.checkpoints.replicas import fits, pool_placement, pool_steps
from dew.checkpoints.restore import MetaCheck, Restored, State, intact, read_manifest, restore_step
from dew.checkpoints.store import (
    TMP,
    Location,
    Store,
    remove_half_written,
    remove_step,
    rmtree,
    store_path,
)
from dew.data.base import DataPartition
from dew.typing import PyTree

__all__ = ["Checkpoints", "Restored"]

_LOG = logging.getLogger("dew.checkpoints")
_CORRUPT = ".dew-corrupt"


@dataclass
class _Pending:
    step: int
    leaves: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    positions: dict[str, Any]
    meta: dict[str, object]
    digests: jax.Array | None = None
    placement: dict[str, Any] | None = None  # a pool's local step: whose shards it holds
    dispatched: threading.Event = field(default_factory=threading.Event)


class Checkpoints:
    """Hold the checkpoints of one run, in one directory.

    save() returns once the arrays are copied off the device; Orbax writes
    them in the background, and a failure of that write is raised by the
    next save() or wait(), naming the step and the directory. keep bounds
    how many committed steps stay on disk once a save has settled (None keeps
    all): older ones are deleted as the next save begins (or fit ends), never
    before a newer one is committed, so between saves, and while one is
    written, one step more is on disk. A save still being written
    when the interpreter exits is finished first (or, when it cannot be,
    abandoned with a message; the previous step stays whole).

    Reading does not write: opening, latest, meta() and restore() leave the
    directory as they found it, but for restore's fallback below, which sets
    a damaged step aside (taking the lease for that moment). The first save() (or acquire()) makes this
    object the directory's writer, holding a lease file that names this
    process until close() or exit; another process's save() is then refused
    with CheckpointLeaseHeldError naming the holder. A lease left by a process
    that is gone is taken over. Only the writer removes half-written steps.

    Every restore checks the step against its manifest, whose own digest is
    checked first: the files' sizes and hashes, the leaves' digests after
    reading. A damaged step raises CheckpointCorruptedError naming the step, the
    file and the newest older good step; with fallback=True (the default, so
    an unattended restart keeps going) restore warns on stderr, moves the
    damaged step aside to ``<step>.dew-corrupt`` (when no other process
    writes the directory; those an earlier restore set aside go) and
    continues from that older step instead. An
    intact step that does not fit the state being restored (another
    optimizer, model or configuration) raises CheckpointTreeMismatchError naming
    the differing leaves, and nothing on disk changes.

    local_directory (one per host) receives the saves the trainer marks
    local, every local_every steps; restore prefers a local step when it is
    newer than the persistent one. In a pool each process writes and commits
    its own shards in ``local_directory/process-<index>`` (see
    checkpoint_local): a local step counts once every process holds it (a
    process that lost its copy takes one from a process on another slice that
    holds the same shards, dew.checkpoints.replicas), and restores only into
    the placement that saved it; otherwise the newest persistent step is
    restored.

    In a pool every process calls every method in the same order; each writes
    its own shards, process 0 holds the lease and commits. On first use
    process 0 writes a probe file that every process must see, and removes it
    (skipped for gs:// buckets).
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
        self.directory = store_path(directory)
        self.keep = keep
        self.local_directory = None if local_directory is None else store_path(local_directory)
        self.local_every = local_every
        self.fallback = fallback
        self._persistent = Store(self.directory, local=False)
        self._local = None if self.local_directory is None else Store(self.local_directory, local=True)
        self._probed = False
        self._writing = False
        self._unclosed: weakref.finalize | None = None  # lets go of the lease if it is dropped unclosed

    def __repr__(self) -> str:
        return f"Checkpoints({str(self.directory)!r}, keep={self.keep})"

    # -- setup ----------------------------------------------------------------

    @property
    def _stores(self) -> list[Store]:
        return [self._persistent] + ([self._local] if self._local is not None else [])

    def _probe(self) -> None:
        """In a pool, check once that every process sees the directory (a lone process skips this)."""
        if self._probed:
            return
        if self._local is not None and pooled() and not self._local.per_process:
            self._local.directory = process_directory(self.local_directory)
            self._local.per_process = True
        probe_shared_directory(self.directory)
        if self._local is not None and isinstance(self._local.directory, Path):
            owner.check_owner(self._local.directory, self.directory)
        self._probed = True

    @property
    def writing(self) -> bool:
        """True once this object is the directory's writer (after acquire() or the first save())."""
        return self._writing

    def acquire(self) -> None:
        """Become the directory's writer now, rather than at the first save().

        Takes the writer's lease (raising CheckpointLeaseHeldError, naming the
        holder, when another live process has it), removes half-written steps
        and opens the Orbax writer. A trainer calls this before it trains, so
        a second run on a live directory is refused before it spends a step.
        """
        if self._writing:
            return
        self._probe()
        self._take_lease(self._stores)
        try:
            if self._local is not None and isinstance(self._local.directory, Path):
                owner.claim_folder(self._local.directory, self.directory)
            for store in self._stores:
                if jax.process_index() == 0 or store.per_process:
                    if store.directory.exists():
                        remove_half_written(store.directory)
                barrier(f"dew-checkpoints-clean-{store.local}")
                options = dict(
                    max_to_keep=None,  # dew prunes, only after the newer step committed
                    create=True,
                    enable_async_checkpointing=True,
                    cleanup_tmp_directories=False,
                    async_options=ocp.AsyncOptions(
                        post_finalization_callback=lambda store=store: self._write_manifest(store)
                    ),
                )
                if store.per_process:
                    store.manager = local_manager(store.directory, options)
                else:
                    store.manager = ocp.CheckpointManager(store.directory,
                                                          options=ocp.CheckpointManagerOptions(**options))
        except BaseException:
            self._release_lease(self._stores)
            raise
        self._writing = True
        # Dropped without close() (a notebook's Trainer deleted): its lease goes with it, or another
        # process would be refused the directory for as long as this one lives.
        self._unclosed = weakref.finalize(self, _let_go, [store.directory for store in self._stores
                                                          if jax.process_index() == 0 or store.per_process])
        _watch_at_exit(self)

    def _take_lease(self, stores: list[Store]) -> None:
        """Process 0 takes the lease of each shared store, every process that of its own local
        store; every process raises if any could not."""
        failure: CheckpointLeaseHeldError | None = None
        taken: list[Store] = []
        try:
            for store in stores:
                if jax.process_index() == 0 or store.per_process:
                    lease.acquire(store.directory)
                    taken.append(store)
        except CheckpointLeaseHeldError as error:
            failure = error
            self._release_lease(taken)
        if pooled():
            if not all_agree(failure is None) and failure is None:
                failure = CheckpointLeaseHeldError(self.directory, self.directory / lease.LEASE,
                                              lease.holder_of(self.directory))
        if failure is not None:
            raise failure

    def _let_go_of_lease(self) -> None:
        if self._unclosed is not None:
            self._unclosed.detach()
            self._unclosed = None
        self._release_lease(self._stores)

    def _release_lease(self, stores: list[Store]) -> None:
        for store in stores:
            if jax.process_index() == 0 or store.per_process:
                lease.release(store.directory)

    # -- queries --------------------------------------------------------------

    @property
    def latest(self) -> int | None:
        """The newest committed step, persistent or local (None when there is none)."""
        self._probe()
        self._settle()
        steps = [step for store in self._stores for step in self._committed(store)]
        return max(steps, default=None)

    def whole(self, step: int) -> bool:
        """Whether step's manifest reads and every file it lists is there at its size (no file is read:
        the cheap half of intact, for saying where a resume goes before the restore checks it all)."""
        self._probe()
        for store, number in self._candidates(step):
            try:
                manifest = self._manifest(store, number)
            except CheckpointCorruptedError:
                continue
            if integrity.verify_sizes(store.step_path(number), manifest.files) is None:
                return True
        return False

    def intact(self, step: int) -> bool:
        """Whether step's manifest and every file it lists are as written (reads every file)."""
        self._probe()
        return any(intact(store.step_path(number), number) for store, number in self._candidates(step))

    def _committed(self, store: Store) -> list[int]:
        """A store's committed steps; for a pool's local store, those every process committed (a
        process that lost one first takes a replica's copy: dew.checkpoints.replicas)."""
        if store.per_process:
            return pool_steps(store)
        return store.committed()

    def path(self, step: int, *, local: bool | None = None) -> Path:
        """The directory of step: in the store local names, or, left None, the persistent one
        unless only the local store holds it (a save still being written is in neither yet)."""
        if local is not None:
            if local and self._local is None:
                raise ValueError("path(..., local=True) needs Checkpoints(local_directory=...).")
            return (self._local if local else self._persistent).step_path(step)  # type: ignore[union-attr]
        if self._local is not None and not self._persistent.step_path(step).exists() \
                and self._local.step_path(step).exists():
            return self._local.step_path(step)
        return self._persistent.step_path(step)

    def manifest(self, step: int) -> dict[str, Any]:
        """The checked manifest of step as plain data: meta, data positions, leaf digests, file checksums.

        Raises CheckpointCorruptedError when the manifest is damaged (see
        checkpoint_manifest), CheckpointNotFoundError when there is no such step.
        """
        self._probe()
        self._settle()
        store, number = self._candidates(int(step))[0]
        return self._manifest(store, number).model_dump()

    def meta(self, step: int | None = None) -> dict[str, Any]:
        """The meta saved with step (default: the newest), read from its checked manifest alone.

        Reads no arrays, so a caller can compare the saved configuration with
        its own before restoring. Raises CheckpointCorruptedError for a damaged
        manifest, CheckpointNotFoundError when there is no such step.
        """
        self._probe()
        self._settle()
        store, number = self._candidates(step)[0]
        return dict(self._manifest(store, number).meta)

    # -- saving ---------------------------------------------------------------

    def prepare(self, state: PyTree) -> None:
        """Get ready, in the background, to save states shaped like state.

        Compiles the program that digests the leaves on their devices, so the
        first save() does not spend that second while the loop waits. A
        trainer calls it once its step runs; save() works without it.
        """
        integrity.prepare_digests(jax.tree_util.tree_leaves(state))

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        position: bytes | None,
        partition: DataPartition,
        meta: Mapping[str, object],
        local: bool = False,
    ) -> None:
        """Start writing state, this process's data position and meta as step.

        Blocks for the copy of the arrays off the device (and for the previous
        save, if it is still writing). A step already committed is not written
        again. meta must be JSON-serializable. The first save makes this object
        the directory's writer (see acquire()).
        """
        step = int(step)
        store = self._local if local else self._persistent
        if store is None:
            raise ValueError("save(..., local=True) needs Checkpoints(local_directory=...).")
        try:
            meta = json.loads(json.dumps(dict(meta)))
        except TypeError as error:
            raise TypeError(f"Checkpoint meta must be JSON-serializable: {error}. Pass plain numbers, "
                            "strings, lists and dicts.") from error
        self.acquire()
        self._settle()
        if step in store.committed():
            _LOG.info("Checkpoint step %s is already in %s; not written again.", step, store.directory)
            return
        pending = _Pending(
            step=step,
            leaves=integrity.leaf_table(state),
            nodes=integrity.node_table(state),
            positions=gather_positions(position, partition),
            meta=dict(meta),
        )
        with store.lock:
            store.pending = pending
        if store.per_process:
            pending.placement = pool_placement(state)
        try:
            saved = ocp.args.PyTreeSave(state) if store.per_process else ocp.args.StandardSave(state)
            assert store.manager is not None  # acquire() opened it
            store.manager.save(step, args=ocp.args.Composite(state=saved), force=True)
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
        if pending.placement is not None:
            (temporary / PLACEMENT).write_text(json.dumps(pending.placement))
        body = {
            "step": pending.step,
            "meta": pending.meta,
            "data": pending.positions,
            "leaves": [
                {**leaf, "digest": digest}
                for leaf, digest in zip(pending.leaves, integrity.digests_as_lists(pending.digests), strict=True)
            ],
            "nodes": pending.nodes,
            "file_hash": integrity.FILE_HASH,
            "files": integrity.file_table(temporary),
        }
        target = temporary / integrity.MANIFEST
        with target.open("wb") as handle:
            handle.write(render_manifest(body))
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
                    # Orbax reported no failure: the step was committed and has since been removed
                    warnings.warn(CheckpointRemovedWarning(
                        f"Checkpoint step {pending.step} was written into {store.directory} and is gone from "
                        "it (removed by hand, or by another program); training goes on, and the next save "
                        "writes a newer step."), stacklevel=2)
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
        stale = store.committed()[: -self.keep]
        if not stale and not pooled():
            return  # nothing to remove: no reload of Orbax's step list while the loop waits
        if jax.process_index() == 0 or store.per_process:
            for step in stale:
                remove_step(store, step)
        barrier(f"dew-checkpoints-pruned-{store.local}")
        assert store.manager is not None  # pruning follows a save, which opened it
        store.manager.reload()

    def wait(self) -> None:
        """Block until every pending save is committed; raise a failed save's error."""
        if self._writing:
            self._settle()

    def close(self) -> None:
        """Wait for pending saves, then release Orbax's resources and the writer's lease."""
        try:
            self.wait()
        finally:
            for store in self._stores:
                if store.manager is not None:
                    store.manager.close()
                    store.manager = None
            if self._writing:
                self._writing = False
                self._let_go_of_lease()
                barrier("dew-checkpoints-closed")  # every process sees the lease gone on return

    def abandon(self) -> int | None:
        """Let go of the saves under way and of the lease without waiting; return the newest step
        abandoned (None when none was being written).

        For a process of a pool whose fit failed: committing a save, pruning and closing are
        collectives the other processes may never reach (they wait inside a step), so waiting
        would hang the pool. The committed steps stay; a step half written is removed by the
        next run that writes the directory.
        """
        abandoned = max((store.pending.step for store in self._stores if store.pending is not None), default=None)
        for store in self._stores:
            store.pending, store.manager = None, None  # Orbax's close would wait for the commit
        if self._writing:
            self._writing = False
            self._let_go_of_lease()
        _watched.discard(self)  # nothing left for the exit hook to finish
        return abandoned

    def _finish_at_exit(self) -> None:
        """Commit (or abandon, saying so) what is still being written, then let go of the lease."""
        pending = [(store, store.pending.step) for store in self._stores if store.pending is not None]
        for store, step in pending:
            print(f"dew: finishing checkpoint step {step} in {store.directory} before exit.", file=sys.stderr,
                  flush=True)
        try:
            self.close()
        except Exception as error:  # noqa: BLE001 - exit must go on; the message names what was lost
            for store, step in pending:
                older = [number for number in store.committed() if number < step]
                kept = f"step {max(older)} is intact" if older else "no older step was there"
                print(f"dew: abandoned checkpoint step {step} in {store.directory} at exit "
                      f"({type(error).__name__}: {str(error).splitlines()[0][:300]}); {kept}.",
                      file=sys.stderr, flush=True)
        else:
            for store, step in pending:
                print(f"dew: checkpoint step {step} in {store.directory} committed.", file=sys.stderr, flush=True)

    # -- restoring ------------------------------------------------------------

    def restore(self, template: State, *, partition: DataPartition, step: int | None = None,
                check: MetaCheck | None = None) -> Restored[State]:
        """Restore step (default: the newest) into the shardings of template's leaves.

        template is a TrainState of jax.ShapeDtypeStruct leaves, each with a
        sharding. check, when given, is called with the step's saved meta and
        the step number before any array is read, so a changed configuration
        is reported as such (its exception propagates, nothing on disk
        changes). Raises CheckpointTreeMismatchError, PositionShareMismatchError or
        CheckpointCorruptedError (see the class docstring for fallback).
        """
        self._probe()
        self._settle()
        candidates = self._placed(self._candidates(step), template, step)
        expected = integrity.leaf_table(template), integrity.node_table(template)
        stale = frozenset(path for store in self._stores if isinstance(store.directory, Path)
                          for path in store.directory.glob(f"*{_CORRUPT}"))
        for index, (store, number) in enumerate(candidates):
            try:
                return restore_step(store.step_path(number), number, template, expected, partition, check)
            except CheckpointCorruptedError as error:
                older = candidates[index + 1:]
                good = self._newest_good(older)
                error = error.with_good(None if good is None else good[1])
                if step is not None or not self.fallback or good is None:
                    raise error from None
                # Said once, on stderr (a logged copy printed it twice under the CLI's logging), and
                # without the API's advice (restore(step=...)), which this fallback has just taken.
                print(f"dew: Checkpoint step {number} is corrupt: {error.file}: {error.reason}. Restoring "
                      f"step {good[1]} instead; step {number} is set aside.", file=sys.stderr, flush=True)
                self._quarantine(store, number, stale)
        raise CheckpointNotFoundError(f"No checkpoint to restore in {self.directory}.")  # pragma: no cover

    def _placed(self, candidates: list[tuple[Store, int]], template: State,
                step: int | None) -> list[tuple[Store, int]]:
        """candidates without the pool's local steps saved from another placement than template's."""
        if not any(store.per_process for store, _ in candidates):
            return candidates
        wanted = placement_of(template)
        kept = []
        for store, number in candidates:
            if store.per_process:
                path = store.step_path(number) / PLACEMENT
                saved = json.loads(path.read_text()) if path.exists() else None
                if not all_agree(fits(saved, wanted)):
                    message = (f"local step {number} in {self.local_directory} holds the shards of another "
                               "placement (a local step restores only into the same processes, mesh and "
                               "layout that saved it)")
                    if step is not None and not any(n == number for s, n in candidates if s is not store):
                        raise LocalPlacementMismatchError(f"{message}; restore a persistent step instead, or the "
                                                     "same placement.")
                    print(f"dew: {message}; skipping it.", file=sys.stderr, flush=True)
                    continue
            kept.append((store, number))
        if not kept:
            raise CheckpointNotFoundError(
                f"No checkpoint in {self.directory} restores into this placement: its local steps were "
                "saved from another one and there is no persistent step.")
        return kept

    def _candidates(self, step: int | None) -> list[tuple[Store, int]]:
        found = [(store, number) for store in reversed(self._stores) for number in self._committed(store)]
        if step is not None:
            found = [(store, number) for store, number in found if number == step]
            if not found:
                raise CheckpointNotFoundError(
                    f"Checkpoint step {step} is not in {self.directory}; it holds steps "
                    f"{sorted({n for s in self._stores for n in self._committed(s)})}."
                )
            return found[-1:]  # the persistent copy when both hold it
        if not found:
            raise CheckpointNotFoundError(
                f"{self.directory} holds no committed checkpoint; check .latest before restoring."
            )
        # Newest first; on a tie the persistent copy (listed last) wins.
        order = {id(self._persistent): 0, id(self._local): 1}
        return sorted(found, key=lambda item: (-item[1], order[id(item[0])]))

    def _manifest(self, store: Store, step: int) -> Manifest:
        return read_manifest(store.step_path(step), step)

    def _newest_good(self, candidates: list[tuple[Store, int]]) -> tuple[Store, int] | None:
        return next(((store, number) for store, number in candidates if intact(store.step_path(number), number)),
                    None)

    def _quarantine(self, store: Store, step: int, stale: frozenset[Path]) -> None:
        """Move a damaged step aside, as the writer (a lease held elsewhere leaves it in place), and
        remove the stale steps (set aside by an earlier restore) of its store."""
        transient = not self._writing
        if transient:
            try:
                self._take_lease([store])
            except CheckpointLeaseHeldError as error:
                who = error.holder.describe() if error.holder is not None else "another process"
                message = f"dew: left damaged step {step} in place, since {who} writes {store.directory}."
                print(message, file=sys.stderr, flush=True)
                return
        try:
            if jax.process_index() == 0:
                source = store.step_path(step)
                target = store.directory / f"{step}{_CORRUPT}"
                if target.exists():
                    rmtree(target)
                source.rename(target)
                # The damage this restore found is kept to look into; steps set aside by earlier
                # restores are full copies of a state that a run damaged again and again piles up.
                earlier = sorted(path for path in stale if path.parent == store.directory and path != target
                                  and path.exists())
                for path in earlier:
                    rmtree(path)
                if earlier:
                    print(f"dew: removed the damaged step(s) an earlier restore set aside: "
                          f"{', '.join(path.name for path in earlier)}.", file=sys.stderr, flush=True)
            barrier(f"dew-checkpoints-quarantine-{step}")
            if store.manager is not None:
                store.manager.reload()
        finally:
            if transient:
                self._release_lease([store])


def _let_go(directories: list[Location]) -> None:
    """Release the leases of a Checkpoints collected while it still wrote (its close never ran)."""
    for directory in directories:
        with contextlib.suppress(Exception):
            lease.release(directory)


_watched: weakref.WeakSet[Checkpoints] = weakref.WeakSet()
_exit_hook = threading.Lock()
_hooked = False


def _watch_at_exit(checkpoints: Checkpoints) -> None:
    """Make sure checkpoints' pending saves are finished (or abandoned, loudly) when Python exits.

    Orbax writes in threads that need concurrent.futures' executors, which
    refuse new work once interpreter shutdown begins; the hook therefore runs
    among threading's own exit calls, before those executors are shut (it is
    registered after them, and they run in reverse order).
    """
    global _hooked
    _watched.add(checkpoints)
    with _exit_hook:
        if _hooked:
            return
        # A private CPython function (run before threads are joined at exit): probed, not assumed.
        register = getattr(threading, "_register_atexit", None)
        if register is None:  # pragma: no cover - every CPython since 3.9 has it
            import atexit

            register = atexit.register
        try:
            register(_finish_all_at_exit)
        except RuntimeError:  # a save during interpreter shutdown: close() is the caller's to call
            return
        _hooked = True


def _finish_all_at_exit() -> None:
    for checkpoints in list(_watched):
        checkpoints._finish_at_exit()
