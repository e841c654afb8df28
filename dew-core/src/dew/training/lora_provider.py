"""The qwix provider behind ``apply_lora``: qwix's LoRA einsum, made to find dew's weights.

Kept apart from ``dew.training.lora`` because it reaches into qwix's
private modules (``qwix._src``), which may move between qwix releases; this
is the one place to change when they do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["provider"]


def provider(qwix: Any) -> Any:
    """qwix's LoraProvider, with an einsum that finds each weight by its name.

    qwix 0.1.8's einsum (a) stores the adapter's einsum string as an
    attribute of the current module, which a linen module refuses outside
    ``setup`` (dew's layers are compact and compute their projections with
    einsum), and (b) finds the weight an einsum reads by identity, and
    failing that by shape: once the base is quantized (QLoRA) the operand is
    a fresh copy of the quantized weight, and dew's query, key and value
    share one shape, so qwix gives up. This provider remembers, per module,
    the name of the latest parameter of each shape the module read (dew's
    layers read a weight right before the einsum that uses it) and takes
    that name when the operand is a quantized weight. (c) qwix's quantized
    weight cannot be cast (``kernel.astype(dtype)`` in dew's layers); the
    layer here gets one that can.
    """
    import jax.numpy as jnp
    from qwix._src.providers import lora as qlora
    from qwix._src.providers import ptq
    from qwix._src.utils import flax_util

    import flax

    @flax.struct.dataclass
    class Held(ptq.WithAux):
        """A quantized weight as a layer reads it: ``astype`` casts its scale (qwix's fails on it)."""

        def astype(self, dtype: Any) -> Any:
            return self.replace(array=flax_util.unbox(self.array).astype(dtype))

    class Provider(qwix.LoraProvider):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._latest: dict[int, dict[tuple[int, ...], str]] = {}

        def nn_param(self, module: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            value = super().nn_param(module, name, *args, **kwargs)
            if isinstance(value, ptq.WithAux):
                value = Held(value.array, value.how)
            shape = getattr(value, "shape", None)
            if shape is not None:
                self._latest.setdefault(id(module), {})[tuple(shape)] = name
            return value

        def _weight_name(self, rhs: Any) -> str | None:
            if isinstance(rhs, ptq.WithAux):  # a quantized weight: never an activation
                module = flax_util.get_current_module()
                return self._latest.get(id(module), {}).get(tuple(rhs.shape))
            try:
                return flax_util.find_param(rhs, ptq.WithAux)
            except ValueError:  # several candidates of its shape: not a weight read as such
                return None

        def einsum(self, einsum_str: str, *operands: Any, **kwargs: Any) -> Any:
            # The name is found before the base einsum quantizes a float weight in place.
            name = self._weight_name(operands[1]) if len(operands) == 2 else None
            result = ptq.PtqProvider.einsum(self, einsum_str, *operands, **kwargs)
            rule, _ = self._get_current_rule_and_op_id("einsum", repeated_call=True)
            if not isinstance(rule, qwix.LoraRule) or name is None:
                return result  # not adapted, or an einsum of two activations (attention scores)
            lhs, rhs = operands
            a_shape, b_shape, lora_str, a_transpose, b_transpose = qlora._parse_einsum_str_for_lora(
                lhs.shape, rhs.shape, einsum_str, rule.rank)
            lora_a, lora_b = qlora._get_or_create_lora_params(
                name=name, rule=rule, a_shape=a_shape, b_shape=b_shape,
                a_sharding_transpose=a_transpose, b_sharding_transpose=b_transpose)
            if rule.dropout > 0:
                from flax import nnx

                lhs = nnx.Dropout(rule.dropout, deterministic=False)(lhs, rngs=flax_util.make_rng("dropout"))
            return result + jnp.einsum(lora_str, lhs, lora_a, lora_b, **kwargs) * (rule.alpha / rule.rank)

    return Provider
