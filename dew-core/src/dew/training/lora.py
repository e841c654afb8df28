"""Low-rank adapters (LoRA, and QLoRA on a quantized base) through Qwix.

``apply_lora(model, Lora(rank=8))`` returns a module whose selected matmuls
add ``x @ A @ B * alpha / rank`` to the base layer's output. Qwix creates
the adapters as parameters beside each selected weight (``query`` gets
``query_lora_a`` and ``query_lora_b``); B starts at zero, so a fresh adapter
leaves the model's output unchanged. ``adapters_only(objective)`` freezes
every other leaf through the objective's ``frozen`` declaration, so the
trainer keeps the base once, with no gradient and no optimizer state, for
any objective. qwix is imported only when a model is wrapped
(``dew-core[quantization]``).

>>> spec = Lora(rank=4, targets=("attention",))
>>> spec.patterns()
('.*layers_\\\\d+/attention',)
>>> is_adapter(("params", "layers_0", "attention", "query_lora_a"), None)
True
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["PRESETS", "Lora", "LoraError", "adapters_only", "apply_lora", "is_adapter", "merge_lora"]

# Named groups of the causal transformer's modules: regular expressions
# matched in full against Flax module paths, as qwix matches its rules.
PRESETS: Mapping[str, str] = {
    "attention": r".*layers_\d+/attention",
    "mlp": r".*layers_\d+/mlp",
}

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")

# The base weights' dtype. Only the stored dtype for now: qwix 0.1.8 finds
# the weight of an einsum by identity, and once the base is quantized
# (int8, nf4) it cannot tell dew's same-shaped query/key/value apart.
BaseDtype = Literal["float32"]


class LoraError(ValueError):
    """A LoRA spec that cannot be applied to this model."""


def is_adapter(path: tuple[str, ...], leaf: Any) -> bool:
    """Whether a variables-tree path names a LoRA adapter (A or B) qwix created."""
    return bool(path) and path[-1].endswith(ADAPTER_SUFFIXES)


@dataclass(frozen=True)
class Lora:
    """Which weights get adapters, of which rank, and the base weights' dtype.

    ``targets`` are preset names (``"attention"``: the query, key, value and
    output projections; ``"mlp"``) or regular expressions matched in full
    against module paths such as ``layers_0/attention``; every weight matmul
    of a matched module gets an adapter. The adapter adds ``alpha / rank`` times its
    low-rank product; ``dropout`` drops the adapter's input during training.
    ``base`` is the frozen weights' dtype; only ``float32`` (the weights as
    stored) is accepted for now, a quantized base (QLoRA) is refused.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention",)
    base: BaseDtype = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        if self.base != "float32":
            raise LoraError(f"Lora.base={self.base!r} is not supported yet: a quantized base (QLoRA) "
                            "needs qwix to find each einsum's weight once quantized; use base='float32'.")
        if self.rank < 1:
            raise LoraError(f"Lora.rank must be a positive integer, not {self.rank}.")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"Lora.dropout must be in [0, 1), not {self.dropout}.")
        if not self.targets:
            raise LoraError("Lora.targets is empty: name a preset (attention, mlp) or a pattern.")
        for pattern in self.patterns():
            try:
                re.compile(pattern)
            except re.error as error:
                raise LoraError(f"Lora target {pattern!r} is not a regular expression: {error}.") from None

    def patterns(self) -> tuple[str, ...]:
        """The targets as regular expressions (presets expanded)."""
        return tuple(PRESETS.get(target, target) for target in self.targets)


def _weights(variables: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter's "module/param" path and shape."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(tree: Mapping[str, Any], prefix: str) -> None:
        for key, value in tree.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                walk(value, path)
            else:
                array = value.unbox() if hasattr(value, "unbox") else value  # a partitioning box
                out[path] = tuple(getattr(array, "shape", ()))

    walk(variables.get("params", {}), "")
    return out


def selected(spec: Lora, variables: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The weights spec adapts in a model of these variables; refuses an idle pattern or a too-large rank."""
    weights = _weights(variables)
    chosen: dict[str, tuple[int, ...]] = {}
    for target, pattern in zip(spec.targets, spec.patterns(), strict=True):
        matched = {path: shape for path, shape in weights.items()
                   if len(shape) >= 2 and re.fullmatch(pattern, path.rsplit("/", 1)[0])}
        if not matched:
            modules = sorted({path.rsplit("/", 1)[0] for path in weights if "/" in path})
            raise LoraError(f"Lora target {target!r} ({pattern}) matches no module of this model; "
                            f"its modules include {', '.join(modules[:6])}.")
        chosen.update(matched)
    for path, shape in chosen.items():
        # The weight is a matrix once its dimensions are split into inputs and
        # outputs; the split is the matmul's, so take the widest one.
        width = max(min(_prod(shape[:cut]), _prod(shape[cut:])) for cut in range(1, len(shape)))
        if spec.rank > width:
            raise LoraError(f"Lora rank {spec.rank} is larger than layer {path} allows "
                            f"(shape {shape}, width {width}); use a rank of at most {width}.")
    return chosen


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def apply_lora(model: Any, spec: Lora) -> Any:
    """model with low-rank adapters on the weights spec targets.

    ``init`` returns the base model's variables plus the adapters (A drawn
    at random, B zero); ``apply`` takes them with the base model's inputs.
    Every other attribute is the base model's (its config, its flops).
    """
    from dew._surface import import_or_explain

    qwix = import_or_explain("qwix", "dew-core")
    modules = "|".join(f"(?:{pattern})" for pattern in spec.patterns())
    rule = qwix.LoraRule(module_path=modules, rank=spec.rank, alpha=spec.alpha,
                         dropout=spec.dropout)
    wrapped = qwix.apply_lora_to_model(model, _provider(qwix)([rule]))
    qwix_class = type(wrapped)
    base_init = qwix_class.init

    def init(self: Any, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """The base model's variables and the adapters, once spec fits this model."""
        import jax

        abstract = jax.eval_shape(lambda: model.init(rngs, *args, **kwargs))
        selected(spec, abstract)
        return base_init(self, rngs, *args, **kwargs)

    # A subclass of qwix's (a linen module still, so objectives accept it);
    # init is set after the class is made so linen does not wrap it.
    checked = type(qwix_class.__name__, (qwix_class,), {})
    checked.init = init
    wrapped.__class__ = checked
    return wrapped


def _provider(qwix: Any) -> Any:
    """qwix's LoraProvider, with an einsum that works inside a compact linen module.

    qwix 0.1.8's einsum stores the adapter's einsum string as an attribute
    of the current module, which a linen module refuses outside ``setup``
    (dew's layers are compact and compute their projections with einsum);
    this einsum is qwix's without that store.
    """
    import jax.numpy as jnp
    from qwix._src.providers import lora as qlora
    from qwix._src.providers import ptq
    from qwix._src.utils import flax_util

    class Provider(qwix.LoraProvider):
        def einsum(self, einsum_str: str, *operands: Any, **kwargs: Any) -> Any:
            result = ptq.PtqProvider.einsum(self, einsum_str, *operands, **kwargs)
            rule, _ = self._get_current_rule_and_op_id("einsum", repeated_call=True)
            if not isinstance(rule, qwix.LoraRule) or len(operands) != 2:
                return result
            lhs, rhs = operands
            name = flax_util.find_param(rhs, ptq.WithAux)
            if name is None:  # an einsum of two activations (attention scores)
                return result
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


class _AdaptersOnly:
    """inner, with every leaf but the adapters frozen (everything else is inner's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def frozen(self) -> Callable[[tuple[str, ...], Any], bool]:
        also = getattr(self.inner, "frozen", None)

        def frozen(path: tuple[str, ...], leaf: Any) -> bool:
            return not is_adapter(path, leaf) or (also is not None and bool(also(path, leaf)))

        return frozen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def adapters_only(objective: Any) -> Any:
    """objective, training the LoRA adapters alone: every other leaf is frozen.

    The result answers every attribute as objective does, except ``frozen``,
    which adds "not an adapter" to objective's own frozen leaves.
    """
    return _AdaptersOnly(objective)


def merge_lora(variables: Mapping[str, Any], spec: Lora) -> dict[str, Any]:
    """The base model's variables with each adapter's product added into its weight.

    The result has the base model's tree (no adapters), so the plain model
    (and any exporter of it) computes what the adapted model computes. The
    adapter's A holds the weight's leading (input) dimensions and B its
    trailing ones, as qwix lays them out for dew's layers; a weight whose
    adapters do not fit that layout is refused.
    """
    import jax.numpy as jnp

    scale = spec.alpha / spec.rank

    def merge(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, Mapping):
                out[key] = merge(value, f"{prefix}/{key}")
            elif not str(key).endswith(ADAPTER_SUFFIXES):
                out[key] = value
        for key in list(out):
            a, b = tree.get(f"{key}_lora_a"), tree.get(f"{key}_lora_b")
            if a is None or b is None:
                continue
            weight = out[key]
            array = weight.unbox() if hasattr(weight, "unbox") else weight
            a, b = (x.unbox() if hasattr(x, "unbox") else x for x in (a, b))
            product = jnp.tensordot(a, b, axes=1)
            if product.size != array.size or product.shape[: a.ndim - 1] != array.shape[: a.ndim - 1]:
                raise LoraError(f"The adapters of {prefix}/{key} (A {a.shape}, B {b.shape}) do not fit "
                                f"its weight of shape {array.shape}; they cannot be merged.")
            merged = (array + scale * product.reshape(array.shape)).astype(array.dtype)
            out[key] = weight.replace_boxed(merged) if hasattr(weight, "replace_boxed") else merged
        return out

    return merge(variables, "")
