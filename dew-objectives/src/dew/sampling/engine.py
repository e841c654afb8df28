"""The generation engine: a paged cache, continuous batching and shared prefixes.

An ``Engine`` keeps the keys and values of every sequence in one pool of
fixed-size blocks on the devices (dew.nn.paged_attention) and schedules the work
on the host, in plain Python:

- ``submit(request, key)`` queues a prompt to continue ``samples`` times. Its
  prompt is written once (in chunks of ``prefill_chunk`` positions) and every
  sample's block table points at the same blocks; the block a sample first
  writes into is copied for it if others still read it (copy-on-write).
- ``step()`` runs one round: admit queued prompts while blocks and rows allow,
  write a chunk of each admitted prompt, start samples in free rows, and decode
  ``steps_per_call`` tokens for every running sequence. A sequence that ends (a
  stop token, a stop string, its max_new_tokens) frees its row and blocks at
  once, and the next queued one takes them: the compiled programs never change.
- When a running sequence needs a block and none is left, the longest running
  sequence is pre-empted: its blocks are freed and it is queued again, first,
  with what it produced so far; it resumes where it stopped.
- A request with ``keep_cache`` keeps each finished sample's blocks:
  ``extend(id, tokens, max_new_tokens)`` continues it after tokens (an
  environment's answer in a multi-turn episode), writing only the new tokens
  (and the last one it produced), and ``release(id)`` lets the blocks go. When
  the pool runs short, kept blocks go first (least recently kept first); a
  continuation of one whose blocks went is written again from its tokens.

Every token is drawn with a key folded from its sequence's key and its
position, so the samples depend only on the keys given to submit, not on the
batch, the schedule or the pre-emptions, and ``snapshot()`` / ``restore()``
carry unfinished sequences into another engine unchanged.

>>> import jax, jax.numpy as jnp
>>> from dew.nn.backbones import CausalTransformer
>>> model = CausalTransformer(vocab_size=16, emb_features=16, num_layers=1, num_heads=2,
...                           mlp_features=32, max_seq_len=32)
>>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
>>> engine = Engine(model, EngineConfig(max_batch=8, block_size=4))
>>> engine.set_params(variables)
>>> group = engine.submit(Request((1, 2, 3, 4, 5), max_new_tokens=6, samples=4), jax.random.key(1))
>>> done = engine.run()
>>> [(c.sample, len(c.tokens)) for c in done]
[(0, 6), (1, 6), (2, 6), (3, 6)]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling import programs
from dew.sampling.blocks import BlockPool
from dew.sampling.errors import (
    EngineConfigError,
    InvalidPromptError,
    InvalidVariablesError,
    PromptTooLongError,
    UnknownSequenceError,
)
from dew.sampling.pool import empty_cache, mesh_of, model_variables
from dew.sampling.requests import (
    Completion,
    EngineConfig,
    EngineSnapshot,
    EngineStats,
    Finish,
    Request,
)
from dew.sampling.sequences import PromptGroup, Sample, sample_keys
from dew.sampling.text import reader
from dew.training.runtime.whole_batch import host_value

if TYPE_CHECKING:
    from dew.sampling.pool import PoolSharding
    from dew.typing import PyTree

__all__ = ["Engine"]


def _unsplit_positions(rules: Any) -> tuple[tuple[str, Any], ...]:
    """rules with the positions of an activation kept whole: a decode step writes one position per
    sequence, which no split of the mesh's sequence axis divides (training splits it, decoding never)."""
    from dew.nn.sharding import ACTIVATION_LENGTH

    return tuple((name, None if name == ACTIVATION_LENGTH else axis) for name, axis in rules)


# Each model's parameter shapes (by leaf path), traced once: what set_params checks variables against.
_EXPECTED: dict[nn.Module, dict[Any, Any]] = {}


class Engine:
    """Generate continuations of many prompts through one paged cache (see the module docstring).

    model is a causal decoder whose attention decodes through a paged cache
    (any model built from dew.nn.layers.CausalSelfAttention or
    dew.nn.latent_attention.LatentAttention: ``causal_transformer`` and every
    registered family, DeepSeek-V3's latent attention included). detokenize (ids -> text) is needed for stop
    strings. vocab, where a tokenizer spells fewer ids than the model scores (a vocabulary padded
    past the tokenizer's), keeps draws below it. On a mesh (taken from the parameters' shardings, or given), the
    programs run under the mesh and rules (default: Layout's; an activation's
    positions are never split, as a decode step has one), and the pool's
    key/value heads are split as the attention's are.
    """

    def __init__(self, model: nn.Module, config: EngineConfig = EngineConfig(), *,
                 detokenize: Callable[[Sequence[int]], str] | None = None, vocab: int | None = None,
                 mesh: jax.sharding.Mesh | None = None, rules: Any = None) -> None:
        self.model = model
        self.config = config
        self.detokenize = detokenize
        self.vocab = None if vocab is None else int(vocab)
        limit = config.max_len or getattr(model, "max_seq_len", None)  # any flax Module: unbounded if it has none
        if limit is None:
            raise EngineConfigError(f"{type(model).__name__} has no max_seq_len; give "
                                    "EngineConfig.max_len.")
        self.max_len = int(min(limit, getattr(model, "max_seq_len", limit)))
        self.width = config.blocks_per_sequence(self.max_len)
        self.blocks = BlockPool(config.pool_blocks(self.max_len), config.block_size)
        self._mesh, self._rules = mesh, rules
        self._variables: dict[str, PyTree] | None = None
        self._cache: PyTree = None
        self._sharding: PoolSharding | None = None
        self._key_impl: str | None = None
        self._waiting: collections.deque[PromptGroup] = collections.deque()
        self._prefilling: list[PromptGroup] = []
        self._ready: collections.deque[PromptGroup] = collections.deque()
        self._running: list[Sample] = []
        self._open: dict[tuple[int, ...], PromptGroup] = {}  # submitted groups whose samples wait
        self._empty: list[Sample] = []  # asked for no new tokens
        self._kept: collections.OrderedDict[int, Sample] = collections.OrderedDict()  # finished, kept
        self._next_id = 0
        self._next_request = 0
        self._counts: collections.Counter[str] = collections.Counter()

    # -- the model -----------------------------------------------------------------
    def set_params(self, params: Mapping[str, PyTree]) -> None:
        """Decode with these variables from now on ({'params': ...}; boxes are accepted).

        The registered prefixes are forgotten (their keys and values came from
        the old weights); sequences in flight keep the keys and values they have.
        """
        variables = model_variables(params)
        self._check_shapes(variables)
        self._variables = variables
        self.blocks.forget()
        self._open.clear()  # a group written with the old weights takes no new samples
        if self._cache is None:
            self._build_cache()

    def _check_shapes(self, variables: Mapping[str, PyTree]) -> None:
        """Refuse parameters this model cannot decode with (another width, another vocabulary),
        named by leaf, rather than with flax's error at the first run()."""
        if self.model not in _EXPECTED:
            try:
                made = jax.eval_shape(self.model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
            except Exception:  # noqa: BLE001 - a model whose init takes other inputs: left to run()
                return
            _EXPECTED[self.model] = dict(jax.tree_util.tree_flatten_with_path(nn.meta.unbox(made["params"]))[0])
        want = _EXPECTED[self.model]
        for path, leaf in jax.tree_util.tree_flatten_with_path(variables["params"])[0]:
            if path in want and tuple(np.shape(leaf)) != tuple(want[path].shape):
                raise InvalidVariablesError(
                    f"The variables given to the engine do not fit its model: params{jax.tree_util.keystr(path)} "
                    f"has shape {tuple(np.shape(leaf))} where the model's has {tuple(want[path].shape)}. Give the "
                    "variables of the model the engine was built with.")

    def _context(self) -> contextlib.ExitStack:
        """The mesh and axis rules the programs trace and run under (nothing on one device)."""
        stack = contextlib.ExitStack()
        if self._mesh is not None:
            stack.enter_context(jax.set_mesh(self._mesh))
            stack.enter_context(nn.logical_axis_rules(self._rules))
        return stack

    def _build_cache(self) -> None:
        assert self._variables is not None  # set_params holds them before the pools are built
        if self._mesh is None:
            self._mesh = mesh_of(self._variables)
        if self._mesh is not None and self._rules is None:
            from dew.training import Layout

            self._rules = Layout().axis_rules
        if self._mesh is not None:
            self._rules = _unsplit_positions(self._rules)
        with self._context():
            self._cache, self._sharding = empty_cache(
                self.model, self._variables, self.blocks.num_blocks, self.config.block_size,
                self.width, self._mesh, self._rules)

    @property
    def cache(self) -> PyTree:
        """The pools (a 'cache' collection of paged_key/paged_value per layer, paged_latent/paged_key_rope
        for latent attention) on the devices."""
        return self._cache

    # -- requests ----------------------------------------------------------------------
    def submit(self, request: Request, key: jax.Array) -> int:
        """Queue request; sample j draws with ``fold_in(key, j)``. Returns the request's id."""
        needed = len(request.prompt) + request.max_new_tokens
        if len(request.prompt) > self.max_len:
            raise PromptTooLongError(
                f"A prompt of {len(request.prompt)} tokens is longer than the cache "
                f"(max_len={self.max_len} positions); shorten the prompt or use a model with a "
                "longer max_seq_len."
            )
        if needed > self.max_len:
            raise PromptTooLongError(
                f"A prompt of {len(request.prompt)} tokens plus max_new_tokens="
                f"{request.max_new_tokens} is {needed} tokens, more than the cache holds "
                f"(max_len={self.max_len}). Ask for at most "
                f"{max(self.max_len - len(request.prompt), 0)} new tokens or shorten the prompt."
            )
        if len(request.stop_tokens) > self.config.max_stop_tokens:
            raise EngineConfigError(
                f"The request has {len(request.stop_tokens)} stop tokens and the engine takes at "
                f"most {self.config.max_stop_tokens}; raise EngineConfig.max_stop_tokens.")
        if request.stop_strings and self.detokenize is None:
            raise EngineConfigError("The request has stop strings; build the Engine with "
                                    "detokenize= (ids -> text) to check them.")
        if not isinstance(key, jax.Array):
            raise InvalidPromptError(f"The engine draws from a JAX key (jax.random.key(seed)), not a "
                                     f"{type(key).__name__}; pass jax.random.key({key!r}) for a seed.")
        vocab = getattr(self.model, "vocab_size", None)  # any decoder; dew's name their vocabulary
        if vocab is not None and not all(0 <= t < vocab for t in request.prompt):
            raise InvalidPromptError(
                f"The prompt holds token ids outside the model's vocabulary of {vocab} ids (0 to {vocab - 1}): "
                f"{sorted({t for t in request.prompt if not 0 <= t < vocab})[:5]}; encode it with the tokenizer "
                "the model was trained with.")
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # a raw uint32 key
            key = jax.random.wrap_key_data(key)
        impl = str(jax.random.key_impl(key))
        if self._key_impl not in (None, impl):
            raise TypeError(f"Keys of {impl} and {self._key_impl} cannot be mixed in one engine.")
        self._key_impl = impl
        keys = sample_keys(key, request.samples)
        rid = self._next_request
        self._next_request += 1
        members = []
        for j in range(request.samples):
            members.append(Sample(self._next_id, rid, j, request, keys[j]))
            self._next_id += 1
        self._queue(list(request.prompt), members)
        return rid

    def _queue(self, tokens: list[int], members: list[Sample], *, first: bool = False) -> None:
        """Queue members to continue tokens: last (a submission) or first (a pre-empted one).

        A submission whose tokens equal those of a group not yet started joins it,
        so prompts submitted one sample at a time are still written once.
        """
        self._empty += [m for m in members if m.remaining <= 0]
        members = [m for m in members if m.remaining > 0]
        if not members:
            return
        if not self.config.share_prefixes:
            groups = [PromptGroup(list(tokens), collections.deque([m])) for m in members]
        else:
            joined = None if first else self._open.get(tuple(tokens))
            if joined is not None:
                joined.members.extend(members)
                return
            groups = [PromptGroup(tokens, collections.deque(members))]
            if not first:
                self._open[tuple(tokens)] = groups[0]
        if first:
            self._waiting.extendleft(reversed(groups))
        else:
            self._waiting.extend(groups)

    def extend(self, sequence: int, tokens: Sequence[int], max_new_tokens: int, *,
               keep_cache: bool = False) -> int:
        """Continue the finished, kept sequence after tokens; returns the continuation's id.

        The continuation samples as its request did (the same key, sampling and
        stops) for at most max_new_tokens; its Completion's prompt is everything
        before its new tokens. Only the tokens not yet in the cache are written.
        """
        if sequence not in self._kept:
            raise UnknownSequenceError(
                f"Sequence {sequence} is not a finished sequence this engine keeps: submit its "
                "request with keep_cache=True, and extend or release each kept sequence once.")
        old = self._kept.pop(sequence)
        history = (*old.tokens, *(int(t) for t in tokens))
        if len(history) + max_new_tokens > self.max_len:
            self._drop(old)
            raise PromptTooLongError(
                f"Sequence {sequence} holds {len(old.tokens)} tokens; {len(tokens)} more plus "
                f"max_new_tokens={max_new_tokens} make {len(history) + max_new_tokens}, more than the "
                f"cache holds (max_len={self.max_len}). Ask for at most "
                f"{max(self.max_len - len(history), 0)} new tokens.")
        spec = dataclasses.replace(old.spec, prompt=history, max_new_tokens=max_new_tokens,
                                   keep_cache=keep_cache)
        follower = Sample(self._next_id, old.request, old.sample, spec, old.key,
                          preemptions=old.preemptions)
        self._next_id += 1
        if not old.blocks or follower.remaining <= 0:  # its blocks went: written again
            self._drop(old)
            self._queue(list(history), [follower])
            return follower.id
        size = self.config.block_size
        written = len(old.tokens) - 1  # the last token it produced was never fed
        column = written // size
        if written % size and self.blocks.references(old.blocks[column]) > 1:
            written = column * size  # a block others read is not written into: its part again
        held = math.ceil(written / size)
        self.blocks.release(old.blocks[held:])
        self._counts["reused_tokens"] += written
        self._waiting.append(PromptGroup(list(history), collections.deque([follower]),
                                         old.blocks[:held], written))
        return follower.id

    def release(self, sequence: int) -> None:
        """Let a finished, kept sequence's blocks go (its episode is over)."""
        if sequence not in self._kept:
            raise UnknownSequenceError(f"Sequence {sequence} is not a finished sequence this engine "
                                       "keeps (already extended or released?).")
        self._drop(self._kept.pop(sequence))

    @property
    def kept(self) -> tuple[int, ...]:
        """The finished sequences whose blocks are kept for extend, least recently kept first."""
        return tuple(self._kept)

    def _drop(self, sequence: Sample) -> None:
        """Release sequence's blocks, registered as a prefix first (a continuation may reuse them)."""
        if sequence.blocks:
            if self.config.share_prefixes:
                self.blocks.register(sequence.tokens[:-1], sequence.blocks)
            self.blocks.release(sequence.blocks)
            sequence.blocks = []

    def _unhold_waiting(self) -> bool:
        """Let queued continuations (not the first) give their blocks back, to be written again."""
        freed = False
        for group in list(self._waiting)[1:]:
            if group.blocks:
                if self.config.share_prefixes:
                    self.blocks.register(group.tokens[:group.written], group.blocks)
                self.blocks.release(group.blocks)
                group.blocks, group.written = [], 0
                freed = True
        return freed

    def _make_room(self, count: int) -> None:
        """Free kept blocks, least recently kept first, until count blocks are available."""
        for sequence in list(self._kept.values()):
            if self.blocks.free_blocks >= count:
                return
            if sequence.blocks:
                self._drop(sequence)
                self._counts["evictions"] += 1

    @property
    def idle(self) -> bool:
        """Whether every submitted sequence has finished."""
        return not (self._waiting or self._prefilling or self._ready or self._running
                    or self._empty)

    def run(self) -> list[Completion]:
        """Step until idle; every completion finished on the way, in submission order."""
        done: list[Completion] = []
        while not self.idle:
            before = (self._counts["prefilled_tokens"], self._counts["generated_tokens"],
                      len(self._waiting), len(self._ready))
            finished = self.step()
            done.extend(finished)
            after = (self._counts["prefilled_tokens"], self._counts["generated_tokens"],
                     len(self._waiting), len(self._ready))
            if after == before and not finished:
                raise RuntimeError("The engine made no progress in a step; this is a bug in its "
                                   "scheduling (please report it with the EngineConfig used).")
        return sorted(done, key=lambda c: c.id)

    def step(self) -> list[Completion]:
        """One round: admit, write a prefill chunk, start samples, decode. Returns what finished."""
        if self._variables is None:
            raise RuntimeError("Call Engine.set_params(variables) before stepping it.")
        finished = [s.completion("length") for s in self._empty]
        self._kept.update((s.id, s) for s in self._empty if s.spec.keep_cache)
        self._empty = []
        self._admit()
        with self._context():
            self._prefill()
            self._start()
            finished += self._decode()
        self._counts["peak_blocks"] = max(self._counts["peak_blocks"], self.blocks.used_blocks)
        return finished

    # -- scheduling ----------------------------------------------------------------------
    def _holding(self) -> bool:
        return bool(self._running or self._prefilling or self._ready)

    def _admit(self) -> None:
        """Move queued groups into prefill while rows and blocks allow."""
        size = self.config.block_size
        while self._waiting:
            group = self._waiting[0]
            pending = sum(len(g.members) for g in (*self._prefilling, *self._ready))
            if len(self._running) + pending >= self.config.max_batch:
                break
            continuing = bool(group.blocks)  # a kept sequence's continuation holds its blocks
            reused = (self.blocks.lookup(group.tokens[:group.target])
                      if self.config.share_prefixes and not continuing else [])
            need = max(math.ceil(group.target / size) - len(group.blocks) - len(reused), 0)
            extra = 1 if self._holding() else 0
            self._make_room(need + extra)
            if need + extra > self.blocks.free_blocks:
                self.blocks.release(reused)
                if not self._holding() and self._unhold_waiting():
                    continue  # continuations queued behind it held the blocks it needs
                break
            if not continuing:
                group.written = len(reused) * size
                self._counts["reused_tokens"] += group.written
            group.blocks = group.blocks + reused + self.blocks.allocate(need)
            self._waiting.popleft()
            (self._ready if group.written >= group.target else self._prefilling).append(group)

    def _prefill(self) -> None:
        jobs = self._prefilling[: self.config.prefill_rows]
        if not jobs:
            return
        size = self.config.block_size
        # One program per power-of-two count of blocks up to prefill_chunk: short prompts
        # are not padded to a long chunk.
        longest = max(min(g.target - g.written, self.config.prefill_chunk) for g in jobs)
        chunk = min(size * 2 ** math.ceil(math.log2(math.ceil(longest / size))),
                    self.config.prefill_chunk, self.max_len)
        rows = self.config.prefill_rows
        tokens = np.zeros((rows, chunk), np.int32)
        positions = np.zeros((rows, chunk), np.int32)
        writes = np.zeros((rows, chunk), bool)
        tables = np.zeros((rows, self.width), np.int32)
        for r, group in enumerate(jobs):
            start = group.written
            end = min(start + chunk, group.target)
            tokens[r, : end - start] = group.tokens[start:end]
            positions[r, : end - start] = np.arange(start, end)
            writes[r, : end - start] = True
            tables[r, : len(group.blocks)] = group.blocks
            group.written = end
            self._counts["prefilled_tokens"] += end - start
        self._cache = programs.prefill(self.model, self._variables, self._cache, tokens, positions,
                                       tables, writes, sharding=self._sharding)
        self._counts["prefill_calls"] += 1
        for group in jobs:
            if group.written >= group.target:
                self._prefilling.remove(group)
                self._ready.append(group)
                if self.config.share_prefixes:
                    self.blocks.register(group.tokens[: group.target], group.blocks)

    def _start(self) -> None:
        while self._ready and len(self._running) < self.config.max_batch:
            group = self._ready[0]
            sequence = group.members.popleft()
            self.blocks.share(group.blocks)
            sequence.blocks = list(group.blocks)
            self._running.append(sequence)
            if not group.members:
                self.blocks.release(group.blocks)
                self._ready.popleft()
                if self._open.get(tuple(group.tokens)) is group:
                    del self._open[tuple(group.tokens)]

    def _preempt(self, sequence: Sample) -> None:
        """Free sequence's blocks and queue it first, to be written again from its tokens."""
        self._running.remove(sequence)
        if self.config.share_prefixes:
            self.blocks.register(sequence.tokens[:-1], sequence.blocks)
        self.blocks.release(sequence.blocks)
        sequence.blocks = []
        sequence.preemptions += 1
        self._counts["preemptions"] += 1
        self._queue(sequence.tokens, [sequence], first=True)

    def _reserve(self) -> list[tuple[int, int]]:
        """Give every running sequence the blocks its next tokens go to, pre-empting the longest
        when the pool runs out. Returns the (source, target) blocks to copy first."""
        size, steps = self.config.block_size, self.config.steps_per_call
        copies: dict[Sample, tuple[int, int]] = {}
        for sequence in list(self._running):
            if sequence not in self._running:
                continue
            position = len(sequence.tokens) - 1
            last = position + min(steps, sequence.remaining) - 1
            column = position // size
            shared = column < len(sequence.blocks) and self.blocks.references(
                sequence.blocks[column]) > 1
            need = max(last // size + 1 - len(sequence.blocks), 0) + int(shared)
            self._make_room(need)
            while need > self.blocks.free_blocks and sequence in self._running:
                victim = max(self._running, key=lambda s: (len(s.tokens), s.id))
                self._preempt(victim)
                copies.pop(victim, None)  # its copy's target went back to the pool
            if sequence not in self._running:
                continue
            if shared:
                (fresh,) = self.blocks.allocate(1)
                copies[sequence] = (sequence.blocks[column], fresh)
                self.blocks.release([sequence.blocks[column]])
                sequence.blocks[column] = fresh
            sequence.blocks += self.blocks.allocate(max(last // size + 1 - len(sequence.blocks), 0))
        self._counts["copies"] += len(copies)
        return list(copies.values())

    def _decode(self) -> list[Completion]:
        if not self._running:
            return []
        copies = self._reserve()
        running = self._running
        if not running:
            return []
        config = self.config
        rows = next(b for b in config.buckets() if b >= len(running))
        no_block = self.blocks.num_blocks
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        tables = np.zeros((rows, self.width), np.int32)
        limits = np.zeros(rows, np.int32)
        keys = np.zeros((rows, *running[0].key.shape), running[0].key.dtype)
        settings = np.tile(np.asarray([[0.0, 1.0, 0.0]], np.float32), (rows, 1))
        top_k = np.zeros(rows, np.int32)
        stops = np.full((rows, config.max_stop_tokens), -1, np.int32)
        copy_from = np.zeros(rows, np.int32)
        copy_to = np.full(rows, no_block, np.int32)
        for i, (source, target) in enumerate(copies):
            copy_from[i], copy_to[i] = source, target
        for r, sequence in enumerate(running):
            spec = sequence.spec
            tokens[r] = sequence.tokens[-1]
            positions[r] = len(sequence.tokens) - 1
            tables[r, : len(sequence.blocks)] = sequence.blocks
            limits[r] = min(config.steps_per_call, sequence.remaining)
            keys[r] = sequence.key
            temperature, k, p, min_p = spec.sampling.as_row()
            settings[r] = (temperature, p, min_p)
            top_k[r] = k
            stops[r, : len(spec.stop_tokens)] = spec.stop_tokens
        filtered = (None if all(s.spec.sampling.greedy for s in running)
                    else any(s.spec.sampling.filtered for s in running))
        self._cache, out, logp = programs.decode(
            self.model, self._variables, self._cache, tokens, positions, tables, limits, keys,
            settings, top_k, stops, copy_from, copy_to, steps=config.steps_per_call,
            filtered=filtered, key_impl=self._key_impl, sharding=self._sharding, vocab=self.vocab)
        self._counts["decode_calls"] += 1
        out, logp = host_value(out), host_value(logp)  # in a pool, spread over every process's devices
        finished = []
        for r, sequence in enumerate(list(running)):
            produced = out[r][out[r] >= 0]
            before = len(sequence.generated)
            sequence.generated += produced.tolist()
            sequence.logprobs += logp[r, : produced.size].tolist()
            self._counts["generated_tokens"] += int(produced.size)
            reason: Finish | None = None
            # A stop string completed before the stop token the device stopped at ends it first.
            if sequence.spec.stop_strings and self._cut_at_stop_string(sequence, before):
                reason = ("stop_token" if int(sequence.generated[-1]) in sequence.spec.stop_tokens
                          else "stop_string")
            elif produced.size and int(produced[-1]) in sequence.spec.stop_tokens:
                reason = "stop_token"
            elif sequence.remaining <= 0:
                reason = "length"
            if reason is not None:
                self._running.remove(sequence)
                if sequence.spec.keep_cache:
                    self._kept[sequence.id] = sequence
                else:
                    self._drop(sequence)
                finished.append(sequence.completion(reason))
        return finished

    def _cut_at_stop_string(self, sequence: Sample, before: int) -> bool:
        """Cut sequence after the token that completed one of its stop strings, if one did."""
        assert self.detokenize is not None
        strings, text = sequence.spec.stop_strings, reader(self.detokenize, sequence.spec.prompt)
        if not any(s in text(sequence.generated) for s in strings):
            return False
        for end in range(before + 1, len(sequence.generated) + 1):
            if any(s in text(sequence.generated[:end]) for s in strings):
                del sequence.generated[end:], sequence.logprobs[end:]
                return True
        return True  # the string spans earlier tokens only when detokenizing is not prefix-stable

    # -- state ---------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """Counts of the work done so far (calls, tokens, pre-emptions, peak blocks held)."""
        return EngineStats(**{name: int(self._counts[name]) for name in EngineStats.__dataclass_fields__})

    @staticmethod
    def compilations() -> int:
        """Programs compiled so far, all engines together (to check that nothing recompiles)."""
        # _cache_size is jax's own count of a jitted function's programs; its JitWrapped stub omits it
        return programs.prefill._cache_size() + programs.decode._cache_size()  # type: ignore[attr-defined]

    def _unfinished(self) -> list[Sample]:
        groups = (*self._waiting, *self._prefilling, *self._ready)
        return sorted([*self._running, *self._empty, *(m for g in groups for m in g.members)],
                      key=lambda s: s.id)

    def snapshot(self) -> EngineSnapshot:
        """Every unfinished sequence with what it produced so far (host values only)."""
        states = tuple(s.state() for s in self._unfinished())
        return EngineSnapshot(states, self._next_id, self._next_request, self._key_impl or "")

    def restore(self, snapshot: EngineSnapshot) -> None:
        """Queue snapshot's sequences in this idle engine; they continue as they would have."""
        if not self.idle:
            raise RuntimeError("Restore a snapshot into an idle engine (this one has sequences "
                               "in flight).")
        self._next_id = max(self._next_id, snapshot.next_id)
        self._next_request = max(self._next_request, snapshot.next_request)
        self._key_impl = snapshot.key_impl or self._key_impl
        for state in snapshot.sequences:  # samples of one prompt not yet started rejoin one group
            sequence = Sample.from_state(state)
            self._queue(sequence.tokens, [sequence])
