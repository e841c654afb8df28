"""The qwix provider behind ``apply_lora``: qwix's LoRA einsum, made to find dew's weights.

Kept apart from ``dew.adapters.lora`` because it reaches into qwix's
private modules (``qwix._src``), which may move between qwix releases; this
is the one place to change when they do.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from collections import deque
from collections.abc import Iterator
from typing import Any

__all__ = ["provider"]

# Where an adapter's draws sit in its module's "params" sequence: far past the module's own weights.
_ADAPTER_DRAWS = 1 << 30


@contextlib.contextmanager
def own_draws(module: Any, name: str) -> Iterator[None]:
    """Inside, an adapter of module's weight name draws from keys of its own.

    qwix makes an adapter's A with the module's next "params" key, so every weight the module
    made after it was drawn from another key than without adapters: a fresh LoRA run started
    from other base weights than the same run without LoRA. Here the adapter's draws take
    counts far past the module's own, named by the weight, and the module's count is put back.
    """
    scope = getattr(module, "scope", None)  # a linen module bound to a scope as it runs
    counters = getattr(scope, "rng_counters", None)
    if not isinstance(counters, dict) or "params" not in counters:  # applied, not initialized
        yield
        return
    before = counters["params"]
    counters["params"] = _ADAPTER_DRAWS + 4 * (zlib.crc32(name.encode()) % (1 << 20))
    try:
        yield
    finally:
        counters["params"] = before


def provider(qwix: Any) -> Any:
    """qwix's LoraProvider, with an einsum that finds each weight by its name.

    qwix 0.1.8's einsum (a) stores the adapter's einsum string as an
    attribute of the current module, which a linen module refuses outside
    ``setup`` (dew's layers are compact and compute their projections with
    einsum), and (b) finds the weight an einsum reads by identity, and
    failing that by shape: once the base is quantized (QLoRA) the operand is
    a fresh copy of the quantized weight, and dew's query, key and value
    share one shape, so qwix gives up (so it does, silently, for weights
    given as numpy arrays). This provider remembers, per module, the names
    of the weights the module read through ``Module.param`` that no einsum
    has used yet, by shape, and gives an einsum's operand the first of its
    shape: dew's layers read each weight right before the einsum that uses
    it, and a layer reading several first uses them in the order it read
    them. An einsum of two activations finds no weight of its operand's
    shape waiting. (c) qwix's quantized
    weight cannot be cast (``kernel.astype(dtype)`` in dew's layers); the
    layer here gets one that can.
    """
    import flax
    import jax.numpy as jnp
    from qwix._src.providers import lora as qlora
    from qwix._src.providers import ptq
    from qwix._src.utils import flax_util

    from dew.adapters.lora import LoraError
    from dew.nn.experts import EXPERT_WEIGHTS, RoutedExperts, too_narrow_to_adapt
    from dew.nn.moe import MoEBlock

    @flax.struct.dataclass
    class Held(ptq.WithAux):
        """A quantized weight as a layer reads it: ``astype`` casts its scale (qwix's fails on it)."""

        def astype(self, dtype: Any) -> Any:
            return self.replace(array=flax_util.unbox(self.array).astype(dtype))

    class Provider(qwix.LoraProvider):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Per live module: the names of the weights it read and no einsum has used yet, by shape.
            self._unused: dict[int, tuple[Any, dict[tuple[int, ...], deque[str]]]] = {}

        def _reads(self, module: Any) -> dict[tuple[int, ...], deque[str]]:
            held = self._unused.get(id(module))
            if held is None or held[0]() is not module:  # a module since collected left its id behind
                held = self._unused[id(module)] = (weakref.ref(module), {})
            return held[1]

        def nn_param(self, module: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            value = super().nn_param(module, name, *args, **kwargs)
            if isinstance(module, RoutedExperts) and name in EXPERT_WEIGHTS:
                return self._expert_weight(module, name, value)
            if isinstance(value, ptq.WithAux):
                value = Held(value.array, value.how)
            shape = tuple(getattr(value, "shape", ()))  # what qwix hands a layer: an array, or not
            if len(shape) >= 2:
                self._reads(module).setdefault(shape, deque()).append(name)
            return value

        def _expert_weight(self, module: Any, name: str, weight: Any) -> Any:
            """weight [E, in, out] plus its per-expert low-rank product, when a LoRA rule matches module."""
            rule, _ = self._get_current_rule_and_op_id("einsum", only_rule=True)
            if not isinstance(rule, qwix.LoraRule):
                return weight  # not adapted: never queued for an einsum (see _weight_name)
            if isinstance(weight, ptq.WithAux) or rule.weight_qtype is not None:
                raise LoraError(f"{'/'.join(module.path)}/{name} is a routed-experts weight, which "
                                "LoRA adapts in float only; use Lora(base='float32') or target the attention (in a "
                                "recipe, lora.base=float32 or lora.targets=[attention]).")
            experts, inputs, outputs = weight.shape
            with own_draws(module, name):
                lora_a, lora_b = qlora._get_or_create_lora_params(
                    name=name, rule=rule, a_shape=(experts, inputs, rule.rank),
                    b_shape=(experts, rule.rank, outputs), a_sharding_transpose=(0, 1, None),
                    b_sharding_transpose=(0, None, 2))
            product = jnp.einsum("eir,ero->eio", lora_a, lora_b)
            return weight + (rule.alpha / rule.rank) * product.astype(weight.dtype)

        def _weight_name(self, rhs: Any) -> str | None:
            """The weight rhs is: the first one of its shape the module read and no einsum used yet."""
            waiting = self._reads(flax_util.get_current_module()).get(tuple(rhs.shape))
            if waiting:
                return waiting.popleft()
            if isinstance(rhs, ptq.WithAux):
                return None
            try:  # a weight not read through Module.param: qwix's own search
                return flax_util.find_param(rhs, ptq.WithAux)
            except ValueError:  # several candidates of its shape
                return None

        def einsum(self, einsum_str: str, *operands: Any, **kwargs: Any) -> Any:
            # The name is found before the base einsum quantizes a float weight in place.
            name = self._weight_name(operands[1]) if len(operands) == 2 else None
            result = ptq.PtqProvider.einsum(self, einsum_str, *operands, **kwargs)
            rule, _ = self._get_current_rule_and_op_id("einsum", repeated_call=True)
            if name is not None and isinstance(rule, qwix.LoraRule) \
                    and isinstance(flax_util.get_current_module(), RoutedExperts | MoEBlock) \
                    and too_narrow_to_adapt(name, tuple(operands[1].shape), rule.rank):
                name = None  # a router or shared gate narrower than the rank stays as trained
            if not isinstance(rule, qwix.LoraRule) or name is None:
                return result  # not adapted, or an einsum of two activations (attention scores)
            lhs, rhs = operands
            a_shape, b_shape, lora_str, a_transpose, b_transpose = qlora._parse_einsum_str_for_lora(
                lhs.shape, rhs.shape, einsum_str, rule.rank)
            with own_draws(flax_util.get_current_module(), name):
                lora_a, lora_b = qlora._get_or_create_lora_params(
                    name=name, rule=rule, a_shape=a_shape, b_shape=b_shape,
                    a_sharding_transpose=a_transpose, b_sharding_transpose=b_transpose)
            return result + jnp.einsum(lora_str, lhs, lora_a, lora_b, **kwargs) * (rule.alpha / rule.rank)

    return Provider
