"""How dew tells a good checkpoint from a damaged one.

Two records are written into a step before Orbax commits it:

* a digest of every leaf, computed on the device from the array's bits and
  its element indices (a weighted sum modulo 2**32, so the value does not
  depend on how the array is sharded, and it is checked again after a restore
  into any placement);
* the size and checksum of every file of the step, so a damaged file is named.
  The checksum is CRC-32 (format 2; SHA-256 in format 1 manifests): these
  records find damage (bit flips, truncation, lost writes), not deliberate
  changes, which no unkeyed hash kept beside the files could stop, and
  CRC-32 reads several times faster, so a restore checks every file while
  Orbax reads them. Array contents are covered twice, by the files and by
  the leaves' digests.

Orbax itself neither reads nor checks either: a flipped byte restores
silently, which is why dew keeps its own.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding

from dew.typing import PyTree

if TYPE_CHECKING:
    from dew.checkpoints.store import Location

__all__ = [
    "COMMIT_FILES", "MANIFEST", "compare_leaves", "compare_nodes", "digest_leaves", "digests_as_lists", "file_table",
    "host_digests", "leaf_table", "node_table", "prepare_digests", "sharding_of", "start_hashing", "verify_files",
    "verify_sizes",
]

MANIFEST = "dew.json"
# Written by Orbax after dew's manifest, so only their presence is recorded.
COMMIT_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
_CHUNK = 1 << 22


def _bits(x: jax.Array) -> jax.Array:
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)  # a trailing axis of 2
    if size in (1, 2):
        narrow = jnp.uint8 if size == 1 else jnp.uint16
        return lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
    raise TypeError(f"dew cannot digest arrays of dtype {x.dtype}; save it as a supported dtype.")


def _axis_weights(length: int, axis: int) -> jax.Array:
    index = lax.iota(jnp.uint32, length)
    salt = jnp.uint32((0x9E3779B1 * (axis + 1)) % 2**32)
    return (index * jnp.uint32(0x85EBCA6B) + salt) * jnp.uint32(0xC2B2AE35) | jnp.uint32(1)


def _digest(x: jax.Array) -> jax.Array:
    """A 32-bit digest: the sum (mod 2**32) of each element's bits times an odd weight of its index.

    The weight of element (i0, i1, ...) is the product of one odd weight per
    axis, applied one axis at a time: each pass multiplies by the leading
    axis's weights and sums it away, so only the first pass touches every
    element (integer reductions are slow on XLA's CPU backend). A changed
    element always changes the sum, since its weight is odd; the sum's order
    does not matter, so the digest is the same under any sharding.
    """
    folded = _bits(x)
    if folded.ndim == 0:
        return folded * jnp.uint32(0x9E3779B1)
    axis = 0
    while folded.ndim:
        weights = _axis_weights(folded.shape[0], axis).reshape((-1,) + (1,) * (folded.ndim - 1))
        folded = jnp.sum(folded * weights, axis=0, dtype=jnp.uint32)
        axis += 1
    return folded


@jax.jit
def _digest_all(leaves: Sequence[jax.Array]) -> jax.Array:
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.stack([_digest(leaf) for leaf in leaves])


# Digest programs compiled ahead (prepare_digests), by the leaves' shapes, dtypes and shardings.
_PREPARED: dict[tuple[Hashable, ...], Future[jax.stages.Compiled]] = {}
_PREPARED_LIMIT = 8
_prepared_lock = threading.Lock()
_compiling: set[threading.Thread] = set()  # digest programs compiling in the background


def _finish_compiles() -> None:
    """At interpreter exit, wait for the digest programs still compiling (a second or so each).

    A run that fails moments after it starts leaves one compiling inside XLA; a daemon thread
    that comes back from native code while the interpreter finalizes is unwound by force, and
    XLA's frames turn that into an abort (exit 134, 'FATAL: exception not rethrown') instead of
    the run's own exit status.
    """
    for thread in list(_compiling):
        thread.join(timeout=120)


atexit.register(_finish_compiles)


def sharding_of(leaf: object) -> Sharding | None:
    """A leaf's sharding: an array's, or a restore template's (None for a host array)."""
    return leaf.sharding if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) else None


def _signature(leaves: Sequence[jax.Array | np.ndarray | jax.ShapeDtypeStruct]) -> tuple[Hashable, ...]:
    return tuple((tuple(leaf.shape), np.dtype(leaf.dtype).str, sharding_of(leaf)) for leaf in leaves)


def prepare_digests(leaves: Sequence[jax.Array | jax.ShapeDtypeStruct]) -> None:
    """Compile the digest program for leaves shaped like these on a background thread.

    Compiling it costs about a second of CPU, which the first save would
    otherwise spend while the loop waits; digest_leaves uses the compiled
    program once it is ready (and waits for it when a save comes first,
    rather than compiling a second time). leaves may be arrays or
    jax.ShapeDtypeStruct with shardings.
    """
    leaves = list(leaves)
    try:
        key = _signature(leaves)
        hash(key)
    except TypeError:  # a sharding that cannot be a key: the first save compiles instead
        return
    with _prepared_lock:
        if key in _PREPARED:
            return
        if len(_PREPARED) >= _PREPARED_LIMIT:
            _PREPARED.pop(next(iter(_PREPARED)))
        future: Future[jax.stages.Compiled] = Future()
        _PREPARED[key] = future
    specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding_of(leaf)) for leaf in leaves]

    def compile_() -> None:
        try:
            future.set_result(_digest_all.lower(specs).compile())
        except BaseException as error:  # noqa: BLE001 - the save then compiles it itself
            future.set_exception(error)
        finally:
            _compiling.discard(threading.current_thread())

    thread = threading.Thread(target=compile_, name="dew-digest-compile", daemon=True)
    _compiling.add(thread)
    thread.start()


def _in_device_memory(leaf: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """leaf, copied to device memory if it sits in host memory (Layout.host): XLA computes
    only on operands in one memory space."""
    sharding = sharding_of(leaf)
    if sharding is None or sharding.memory_kind is None or sharding.memory_kind == "device":
        return leaf
    return jax.device_put(leaf, sharding.with_memory_kind("device"))


def digest_leaves(leaves: Sequence[jax.Array | np.ndarray]) -> jax.Array:
    """Dispatch the digests of leaves (uint32[len(leaves)]) without waiting for them."""
    leaves = [_in_device_memory(leaf) for leaf in leaves]
    try:
        future = _PREPARED.get(_signature(leaves))
    except TypeError:
        future = None
    if future is not None:
        try:
            return future.result()(leaves)
        except Exception:  # noqa: BLE001 - not compiled, or for other placements: compile now
            pass
    return _digest_all(leaves)


def leaf_table(state: PyTree) -> list[dict[str, Any]]:
    """Path, shape and dtype of every leaf, in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    for path, leaf in flat:
        if jnp.dtype(leaf.dtype).itemsize not in (1, 2, 4, 8):
            raise TypeError(f"Leaf {jax.tree_util.keystr(path)} has dtype {leaf.dtype}, which dew cannot "
                            "digest; keep checkpointed leaves in 8-, 16-, 32- or 64-bit dtypes.")
    return [
        {"path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.dtype))}
        for path, leaf in flat
    ]


FILE_HASH = "crc32"  # what new manifests record; "sha256" is read in older ones
_NAMES = {"crc32": "CRC-32", "sha256": "SHA-256"}


def _checksum(path: Location, algorithm: str = FILE_HASH) -> str:
    """The file's checksum as hex (zlib and hashlib release the GIL on large chunks)."""
    with path.open("rb") as handle:
        if algorithm == "crc32":
            value = 0
            while chunk := handle.read(_CHUNK):
                value = zlib.crc32(chunk, value)
            return f"{value:08x}"
        digest = hashlib.new(algorithm)
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        return digest.hexdigest()


def _files(root: Location) -> list[Location]:
    found = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.is_dir():
            found.extend(_files(entry))
        else:
            found.append(entry)
    return found


def file_table(step_directory: Location) -> dict[str, list[int | str]]:
    """Size and checksum (FILE_HASH) of every file under step_directory, by relative path."""
    table: dict[str, list[int | str]] = {}
    for file in _files(step_directory):
        relative = str(PurePosixPath(*file.parts[len(step_directory.parts):]))
        if relative in COMMIT_FILES or relative == MANIFEST:
            continue
        table[relative] = [file.stat().st_size, _checksum(file)]
    return table


def verify_sizes(step_directory: Location, table: Mapping[str, Sequence[int | str]]) -> tuple[str, str] | None:
    """The first (file, what is wrong) whose presence or size disagrees with table (no file is read)."""
    for name in COMMIT_FILES:
        if not (step_directory / name).exists():
            return str(step_directory / name), "the file is missing"
    for relative, (size, _) in sorted(table.items()):
        file = step_directory / relative
        if not file.exists():
            return str(file), "the file is missing"
        actual = file.stat().st_size
        if actual != size:
            return str(file), f"it holds {actual} bytes where {size} were written (truncated or altered)"
    return None


def _algorithm_of(recorded: object) -> str:
    return "sha256" if isinstance(recorded, str) and len(recorded) == 64 else "crc32"


def start_hashing(step_directory: Location, table: Mapping[str, Sequence[int | str]],
                  pool: ThreadPoolExecutor | None = None,
                  algorithm: str | None = None) -> Callable[[], tuple[str, str] | None]:
    """Hash table's files on pool's threads; the returned call waits and names the first bad file.

    algorithm is the manifest's file_hash; None tells it from each recorded
    value's length (8 hex digits: CRC-32, 64: SHA-256).

    hashlib releases the GIL while it hashes, so the threads run beside
    whatever the caller does meanwhile (Orbax reading the same files).
    """
    names = sorted(table)
    if not names:
        return lambda: None
    own = pool is None
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=min(4, len(names)), thread_name_prefix="dew-verify")
    algorithms = {name: algorithm or _algorithm_of(table[name][1]) for name in names}
    futures = [pool.submit(_checksum, step_directory / name, algorithms[name]) for name in names]
    if own:
        pool.shutdown(wait=False)

    def finish() -> tuple[str, str] | None:
        problem = None
        for name, future in zip(names, futures, strict=True):
            try:
                sha = future.result()
            except OSError as error:
                sha = None
                found = (str(step_directory / name), f"it cannot be read ({error})")
            else:
                found = (str(step_directory / name),
                         f"its contents differ from what was written ({_NAMES[algorithms[name]]} mismatch)")
            if sha != table[name][1] and problem is None:
                problem = found
        return problem

    return finish


def verify_files(step_directory: Location, table: Mapping[str, Sequence[int | str]],
                 algorithm: str | None = None) -> tuple[str, str] | None:
    """The first (file, what is wrong) that disagrees with table, or None when all agree."""
    return verify_sizes(step_directory, table) or start_hashing(step_directory, table, algorithm=algorithm)()


_WIDENED = {("bfloat16", "float32"), ("float16", "float32")}


def widened_leaves(saved: Sequence[Mapping[str, Any]], expected: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The leaves saved in bfloat16 or float16 that the state holds, same shape, in float32 (path to
    saved dtype): read as saved and widened, they are exactly what was written. An older dew kept a
    reduced-precision run's EMA and float16 optimizer state in the weights' dtype."""
    after = {leaf["path"]: leaf for leaf in expected}
    return {leaf["path"]: leaf["dtype"] for leaf in saved if leaf["path"] in after
            and list(leaf["shape"]) == list(after[leaf["path"]]["shape"])
            and (leaf["dtype"], after[leaf["path"]]["dtype"]) in _WIDENED}


def compare_leaves(saved: Sequence[Mapping[str, Any]], expected: Sequence[Mapping[str, Any]]) -> list[str]:
    """Describe every leaf whose path, shape or dtype differs between two leaf tables (a leaf the
    state widens losslessly, widened_leaves', differs in nothing that matters)."""
    before = {leaf["path"]: leaf for leaf in saved}
    after = {leaf["path"]: leaf for leaf in expected}
    widened = widened_leaves(saved, expected)
    differences = [f"{path} is in the checkpoint but not in the state" for path in before if path not in after]
    differences += [f"{path} is in the state but not in the checkpoint" for path in after if path not in before]
    recast: dict[tuple[str, str], list[str]] = {}  # leaves differing only in dtype, by (saved, state) dtype
    for path in before.keys() & after.keys() - widened.keys():
        old, new = before[path], after[path]
        if list(old["shape"]) == list(new["shape"]) and old["dtype"] != new["dtype"]:
            recast.setdefault((old["dtype"], new["dtype"]), []).append(path)
        elif list(old["shape"]) != list(new["shape"]):
            differences.append(
                f"{path} was saved as {old['dtype']}{list(old['shape'])}, the state has {new['dtype']}{list(new['shape'])}"
            )
    # One line per dtype change: a changed dtype setting differs in every weight, and a line per leaf
    # would bury what changed.
    for (was, now), paths in recast.items():
        named = sorted(paths, key=lambda path: (not path.startswith(".params"), path))  # the weights first
        if len(named) == 1:
            shape = list(before[named[0]]["shape"])
            differences.append(f"{named[0]} was saved as {was}{shape}, the state has {now}{shape}")
            continue
        differences.append(
            f"{len(named)} leaves were saved as {was} and the state has them as {now}, shapes alike "
            f"({named[0]}, {named[1]}{', ...' if len(named) > 2 else ''}): a dtype setting of the recipe "
            "(the model's param_dtype, say) differs from the one the run trained with")
    return sorted(differences)


def _children(tree: PyTree) -> list[tuple[Hashable, PyTree]] | None:
    """tree's immediate (key, child) pairs, or None when tree is a leaf."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)
    if len(pairs) == 1 and pairs[0][0] == () and pairs[0][1] is tree:
        return None
    return [(path[0], child) for path, child in pairs]


def node_table(tree: PyTree) -> list[dict[str, Any]]:
    """Path, type name and child count of every interior node (None and empty nodes included).

    Two trees with the same leaves can still differ here: optax's adam and
    adamw hold the same arrays, but adamw's state has one more (empty) node.
    """
    table: list[dict[str, Any]] = []

    def walk(node: PyTree, prefix: str) -> None:
        children = _children(node)
        if children is None:
            return
        table.append({"path": prefix or "<root>", "type": type(node).__name__, "children": len(children)})
        for key, child in children:
            walk(child, prefix + jax.tree_util.keystr((key,)))

    walk(tree, "")
    return table


def compare_nodes(saved: Sequence[Mapping[str, Any]], expected: Sequence[Mapping[str, Any]]) -> list[str]:
    """Describe every interior node whose child count differs between two node tables.

    Type names alone are not compared: a dict restores into a FrozenDict and a
    list into a tuple, so only a different shape of the tree is a mismatch.
    """
    before = {node["path"]: node for node in saved}
    after = {node["path"]: node for node in expected}
    differences = [f"{path} ({before[path]['type']}) is in the checkpoint but not in the state"
                   for path in before if path not in after]
    differences += [f"{path} ({after[path]['type']}) is in the state but not in the checkpoint"
                    for path in after if path not in before]
    for path in before.keys() & after.keys():
        old, new = before[path], after[path]
        if old["children"] != new["children"]:
            differences.append(f"{path} was saved as {old['type']} of {old['children']} children, the state "
                               f"has {new['type']} of {new['children']}")
    return sorted(differences)


def _host_weights(length: int, axis: int) -> np.ndarray:
    """_axis_weights computed by numpy: the same uint32 values."""
    index = np.arange(length, dtype=np.uint32)
    salt = np.uint32((0x9E3779B1 * (axis + 1)) % 2**32)
    return (index * np.uint32(0x85EBCA6B) + salt) * np.uint32(0xC2B2AE35) | np.uint32(1)


def _host_bits(block: np.ndarray) -> np.ndarray:
    size = block.dtype.itemsize
    if block.dtype == np.bool_:
        return block.astype(np.uint32)
    if size == 4:
        return block.view(np.uint32)
    if size == 8:
        return np.ascontiguousarray(block).view(np.uint32).reshape(block.shape + (2,))
    return block.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)


def _host_digest(array: jax.Array) -> int:
    """_digest of array computed by numpy from its shards in host memory (no device work).

    The digest is a sum over elements of bits times a product of per-axis
    weights, so each distinct shard contributes its own partial sum, folded
    with the slices of the weights its index covers.
    """
    total = np.uint32(0)
    seen: set[tuple[tuple[int, int], ...]] = set()
    with np.errstate(over="ignore"):
        for shard in array.addressable_shards:
            bounds = tuple(
                (part.start or 0, length if part.stop is None else part.stop)
                for part, length in zip(shard.index, array.shape, strict=False)
            )
            if bounds in seen:
                continue  # a replica of a block already counted
            seen.add(bounds)
            total = np.uint32(total + _block_sum(np.asarray(shard.data), bounds, array.shape))
    return int(total)


def host_digests(arrays: Sequence[np.ndarray]) -> list[int]:
    """The digests of whole arrays in host memory, as digest_leaves computes them, by numpy: no
    copy to a device and no temporary of an array's size (a restore's leaves, read as numpy)."""
    with np.errstate(over="ignore"):
        return [int(_block_sum(array, tuple((0, length) for length in array.shape), array.shape))
                for array in map(np.asarray, arrays)]


def _block_sum(block: np.ndarray, bounds: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> np.uint32:
    """One block's part of its array's digest: its bits times the weights of the places it covers."""
    folded = _host_bits(block)
    if folded.ndim == 0:
        return np.uint32(folded * np.uint32(0x9E3779B1))
    starts = [start for start, _ in bounds] + [0] * (folded.ndim - len(bounds))
    lengths = list(shape) + list(folded.shape[len(bounds):])
    for axis in range(folded.ndim):
        weights = _host_weights(lengths[axis], axis)[starts[axis]: starts[axis] + folded.shape[0]]
        # One pass, no temporary of the block's size (einsum keeps the product in uint32).
        folded = np.einsum("i,i...->...", weights, folded, dtype=np.uint32, casting="unsafe")
    return np.uint32(folded)


def _on_host(leaf: object) -> bool:
    return (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
            and all(device.platform == "cpu"  # type: ignore[attr-defined]  # jax.Device declares none
                    for device in leaf.sharding.device_set))


def start_digests(leaves: Sequence[jax.Array], pool: ThreadPoolExecutor) -> Callable[[], list[int]]:
    """Start computing the digests of leaves; the returned call waits for them as plain ints.

    Arrays in host memory (the CPU backend) are digested by numpy on pool's
    threads, several times faster than XLA's CPU integer reductions; anything
    else on its devices. Both give the same numbers.
    """
    leaves = list(leaves)
    if leaves and all(_on_host(leaf) for leaf in leaves):
        futures = [pool.submit(_host_digest, leaf) for leaf in leaves]
        return lambda: [future.result() for future in futures]
    digests = digest_leaves(leaves)
    return lambda: digests_as_lists(digests)


def digests_as_lists(digests: jax.Array) -> list[int]:
    """Fetch digests to the host as plain ints (blocks until they are computed)."""
    if digests.is_fully_replicated:
        digests = digests.addressable_data(0)
    return np.asarray(digests).astype(np.int64).tolist()
