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

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dew.errors import DewError
from dew.nn.sharding import LAYERS
from dew.objectives.base import Aux, Batch, Mean, Metric, Objective, Step, Variables
from dew.typing import PyTree

if TYPE_CHECKING:
    import jax
    import numpy as np
    from flax.linen import Module

    from dew.objectives.inference import Pipeline
    from dew.telemetry.artifacts import Artifact
    from dew.training.initializers import Initializer, WeightSource
    from dew.training.protocols import Rollout
    from dew.training.state import TrainState

__all__ = ["PRESETS", "BaseWeights", "Lora", "LoraError", "adapters_only", "apply_lora", "base_digest", "base_model", "base_of",
           "base_shapes", "is_adapter", "merge_lora", "with_base"]

# Named groups of the causal transformer's modules: regular expressions
# matched in full against Flax module paths, as qwix matches its rules.
PRESETS: Mapping[str, str] = {
    "attention": r".*layers_\d+/attention",
    # The feed-forward blocks: dense (mlp), and in a mixture-of-experts family the routed block
    # (moe: each expert's own adapters on the stacked wi/wi_gate/wo, and its router and shared
    # gate where the rank fits them, dew.nn.experts.ROUTING_WEIGHTS) and its shared experts.
    "mlp": r".*layers_\d+/(?:mlp|moe|moe/shared)",
}

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")

# The base weights' dtype: as stored (float32), or quantized for QLoRA, the
# adapted weights held as int8 or 4-bit NormalFloat codes with their scales.
BaseDtype = Literal["float32", "int8", "nf4"]
QTYPES: Mapping[str, str | None] = {"float32": None, "int8": "int8", "nf4": "nf4"}


class LoraError(DewError, ValueError):
    """A LoRA spec that cannot be applied to this model."""


def matched_nothing(target: str, pattern: str, modules: Iterable[str]) -> LoraError:
    """The error for a target that adapts no module, listing the model's modules as patterns.

    Numbers in a path become ``\\d+``, so a video DiT's ``space_0/attention`` ...
    ``time_3/attention`` read as two patterns a target can use, rather than a
    first few names in alphabetical order that miss the repeated blocks.

    >>> str(matched_nothing("mlp", ".*mlp", ["final", "layers_0/attention", "layers_1/attention"]))[-39:]
    'which are: final, layers_\\\\d+/attention.'
    """
    shapes = list(dict.fromkeys(re.sub(r"\d+", r"\\d+", module) for module in sorted(modules)))
    shown = ", ".join(shapes[:_LISTED]) + (f", and {len(shapes) - _LISTED} more" if len(shapes) > _LISTED else "")
    return LoraError(f"Lora target {target!r} ({pattern}) matches no module of this model. Targets are "
                     f"regular expressions over its module paths, which are: {shown}.")


_LISTED = 16  # module patterns a no-match error lists


def is_adapter(path: tuple[str, ...], leaf: PyTree) -> bool:
    """Whether a variables-tree path names a LoRA adapter (A or B) qwix created."""
    return bool(path) and path[-1].endswith(ADAPTER_SUFFIXES)


@dataclass(frozen=True)
class Lora:
    """Which weights get adapters, of which rank, and the base weights' dtype.

    ``targets`` are preset names (``"attention"``: the query, key, value and
    output projections; ``"mlp"``) or regular expressions matched in full
    against module paths such as ``layers_0/attention``; every weight matmul
    of a matched module gets an adapter. On a model whose layers are one scanned stack
    (``scan_layers=True``) the targets still name the numbered layers, and must
    pick a module in every layer or none (``dew.adapters.lora_stack``); the
    adapters are then stacked like the weights. In a mixture-of-experts family
    ``"mlp"`` also names the routed block (``layers_N/moe``: the experts'
    stacked weights, each expert with its own low-rank pair; its router and
    shared gate where the rank fits them, else left as trained) and its shared
    experts; routed experts take LoRA in float. The adapter adds ``alpha / rank`` times its
    low-rank product. ``dropout`` must stay 0: dew's training step hands the
    adapters no random key, so a dropout is refused rather than left unapplied.
    ``base`` is the frozen weights' dtype: ``float32`` keeps them as stored;
    ``int8`` or ``nf4`` (QLoRA) holds each adapted weight quantized, in
    int8 or 4-bit NormalFloat, and computes with it; the adapters stay in
    float. ``block_size`` is how many inputs share one absmax scale: None
    gives each output channel one scale over all its inputs; the QLoRA paper
    uses blocks of 64 (a smaller error for 1/64 more scales; its second
    quantization of the scales is not done). It must divide the last input
    axis of every adapted weight: an attention's output projection takes its
    blocks along the head size, each block spanning every head.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention",)
    base: BaseDtype = "float32"
    block_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        if self.base not in QTYPES:
            raise LoraError(f"Lora.base={self.base!r} is not a base dtype; use one of {', '.join(QTYPES)}.")
        if self.block_size is not None:
            if isinstance(self.block_size, bool) or int(self.block_size) != self.block_size or self.block_size < 1:
                raise LoraError(f"Lora.block_size must be a positive whole number of inputs or None, "
                                f"not {self.block_size!r}.")
            if QTYPES[self.base] is None:
                raise LoraError(f"Lora.block_size={self.block_size} sets the quantization blocks of the frozen "
                                f"base, which base={self.base!r} keeps in float: set lora.base to nf4 or int8, "
                                "or leave block_size unset.")
        if self.rank < 1:
            raise LoraError(f"Lora.rank must be a positive integer, not {self.rank}.")
        if not 0 < self.alpha < math.inf:  # the adapters' output scales by alpha / rank: 0 trains nothing
            raise LoraError(f"Lora.alpha must be above 0 and a finite number (the adapters are scaled by alpha / "
                            f"rank), not {self.alpha}.")
        if self.dropout != 0.0:
            raise LoraError(f"Lora.dropout={self.dropout} is not applied by dew: the training step hands the "
                            "adapters no random key for it. Set lora.dropout to 0 (the default).")
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


def _weights(variables: Mapping[str, PyTree]) -> dict[str, tuple[int, ...]]:
    """Every parameter's "module/param" path and shape."""
    import numpy as np

    out: dict[str, tuple[int, ...]] = {}

    def walk(tree: Mapping[str, PyTree], prefix: str) -> None:
        for key, value in tree.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                walk(value, path)
            else:
                out[path] = tuple(np.shape(_unbox(value)))  # a partitioning box, or the array

    walk(variables.get("params", {}), "")
    return out


def selected(spec: Lora, variables: Mapping[str, PyTree],
             patterns: tuple[str, ...] | None = None) -> dict[str, tuple[int, ...]]:
    """The weights spec adapts in a model of these variables; refuses an idle pattern or a too-large rank.

    patterns replaces spec's own (a scanned stack's exact module paths, one per target or
    more: dew.adapters.lora_stack); a stacked weight's rank limit is one layer's.
    """
    from dew.adapters.lora_stack import stacked_width_shape

    weights = _weights(variables)
    chosen: dict[str, tuple[int, ...]] = {}
    pairs = zip(spec.targets, spec.patterns(), strict=True) if patterns is None else (
        (pattern, pattern) for pattern in patterns)
    from dew.nn.experts import too_narrow_to_adapt

    for target, pattern in pairs:
        # A bias (a published family's q/k/v_bias) is added, never multiplied: it gets no adapter;
        # nor does an experts block's router or shared gate narrower than the rank (ROUTING_WEIGHTS).
        matched = {path: shape for path, shape in weights.items()
                   if len(shape) >= 2 and not path.endswith("_bias")
                   and not (_in_experts_block(path, weights)
                            and too_narrow_to_adapt(path.rsplit("/", 1)[-1], shape, spec.rank))
                   and re.fullmatch(pattern, _module_of(path))}
        if not matched:
            raise matched_nothing(target, pattern, {_module_of(path) for path in weights if "/" in path})
        chosen.update(matched)
    for path, stored in chosen.items():
        shape = stacked_width_shape(path, stored)
        if _is_expert_weight(path, weights):  # one [in, out] matrix per expert, each adapted alone
            shape = shape[-2:]
        # The weight is a matrix once its dimensions are split into inputs and
        # outputs; the split is the matmul's, so take the widest one.
        width = max(min(_prod(shape[:cut]), _prod(shape[cut:])) for cut in range(1, len(shape)))
        if spec.rank > width:
            raise LoraError(f"Lora rank {spec.rank} is larger than layer {path} allows "
                            f"(shape {shape}, width {width}); use a rank of at most {width}.")
    return chosen


def _module_of(path: str) -> str:
    """The module a "module/param" path names ("" for a parameter of the model itself: its head)."""
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _in_experts_block(path: str, weights: Mapping[str, PyTree]) -> bool:
    """Whether path ("module/param") is a weight of an experts block (a module with a router)."""
    return f"{_module_of(path)}/router" in weights


def _is_expert_weight(path: str, weights: Mapping[str, PyTree]) -> bool:
    """Whether path ("module/param") is a routed-experts block's stacked [E, in, out] weight."""
    from dew.nn.experts import EXPERT_WEIGHTS

    module, name = _module_of(path), path.rsplit("/", 1)[-1]
    return name in EXPERT_WEIGHTS and f"{module}/router" in weights


def _refuse_unadapted(spec: Lora, chosen: Mapping[str, tuple[int, ...]], variables: Mapping[str, PyTree]) -> None:
    """Refuse targets that matched weights no adapter was placed on: a weight the model does not
    multiply as a matrix (an embedding is a lookup), or one of the model's own (its head)."""
    adapters = {path.split("_lora_", 1)[0] for path in _weights(variables) if "_lora_" in path}
    # An embedding table is a lookup: qwix adapts it only where a tied head multiplies by it, an
    # adapter no export can merge into the table or hand to PEFT; it is refused either way.
    missing = sorted(path for path in chosen if path not in adapters or path.rsplit("/", 1)[-1] == "embedding")
    if missing:
        raise LoraError(
            f"Lora targets {list(spec.targets)} match {', '.join(missing[:4])}"
            f"{' and more' if len(missing) > 4 else ''}, where no adapter can sit: the model does not "
            "multiply by that weight as a projection (an embedding is a lookup; the output head belongs "
            "to no layer). Name the projections to adapt: attention, mlp, or a pattern over their modules.")


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def apply_lora(model: Module, spec: Lora) -> Module:
    """model with low-rank adapters on the weights spec targets.

    ``init`` returns the base model's variables plus the adapters (A drawn
    at random, B zero); ``apply`` takes them with the base model's inputs.
    Every other attribute is the base model's (its config, its flops).
    """
    from dew._surface import import_or_explain
    from dew.adapters.lora_stack import is_scanned, stacked_patterns

    qwix = import_or_explain("qwix", "dew-core")
    # A scanned stack is one module for every layer: the numbered names the targets are
    # written for are read as the stack's own paths (every layer or none).
    patterns = stacked_patterns(model, spec) if is_scanned(model) else None
    modules = "|".join(f"(?:{pattern})" for pattern in patterns or spec.patterns())
    rule = qwix.LoraRule(module_path=modules, rank=spec.rank, alpha=spec.alpha,
                         dropout=spec.dropout, weight_qtype=QTYPES[spec.base], tile_size=spec.block_size)
    from dew.adapters.lora_provider import provider

    wrapped = qwix.apply_lora_to_model(model, provider(qwix)([rule]))
    qwix_class = type(wrapped)
    base_init = qwix_class.init

    def init(self: Any, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """The base model's variables and the adapters, once spec fits this model."""
        import jax

        abstract = jax.eval_shape(lambda: model.init(rngs, *args, **kwargs))
        chosen = selected(spec, abstract, patterns)
        try:
            variables = bytewise(base_init(self, rngs, *args, **kwargs))
        except ValueError as error:
            if spec.block_size is None or "cannot be tiled" not in str(error):
                raise
            raise LoraError(f"Lora.block_size={spec.block_size} does not divide the inputs of adapted weights such as "
                            f"{_weight_of_shape(abstract, str(error))}; choose a block size that divides the model's "
                            "width and head size, or leave block_size unset for one scale per output channel.") from None
        _refuse_unadapted(spec, chosen, variables)
        return variables

    # A subclass of qwix's (a linen module still, so objectives accept it);
    # init is set after the class is made so linen does not wrap it.
    # dew_base_model a tuple: linen would wrap a module. intercepts_jax: dew.training.opening.InterceptsJax.
    checked = type(qwix_class.__name__, (qwix_class,), {"dew_base_model": (model,), "intercepts_jax": True})
    checked.init = init  # type: ignore[attr-defined]  # a linen Module class: it has init
    wrapped.__class__ = checked
    return wrapped


def base_model(model: Module) -> Module:
    """The model apply_lora wrapped (model itself when it wraps nothing)."""
    held = getattr(type(model), "dew_base_model", None)  # any flax Module: only apply_lora's has it
    return model if held is None else held[0]


def _digest_part(entry: object) -> object:
    """A path entry as the base digest names it: a key or an attribute's name, else the entry."""
    import jax

    if isinstance(entry, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
        return entry.key
    return entry.name if isinstance(entry, jax.tree_util.GetAttrKey) else entry


def _weight_of_shape(abstract: PyTree, message: str) -> str:
    """The path and shape of the first weight whose shape qwix's tiling message names (its text, when
    none has it)."""
    import jax

    found = re.match(r"\s*\(([\d, ]*)\)", message)
    shape = tuple(int(n) for n in found.group(1).split(",") if n.strip()) if found else None
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        if tuple(getattr(leaf, "shape", ())) == shape:  # any leaf of the abstract tree: a ShapeDtypeStruct
            named = [str(k.key) for k in path[1:] if isinstance(k, jax.tree_util.DictKey)]  # no box's .value
            return "/".join(named) + f" {shape}"
    return f"(qwix: {message})"


def _unbox(leaf: PyTree) -> PyTree:
    from flax.core import meta

    return leaf.unbox() if isinstance(leaf, meta.AxisMetadata) else leaf


def _unbox_tree(tree: PyTree) -> PyTree:
    import flax.linen as nn

    return nn.meta.unbox(tree)


def _is_quantized(leaf: object) -> bool:
    """Whether leaf is a weight qwix holds quantized (its WithAux: codes, scales, how)."""
    # qwix is an optional dependency, so its class is matched by name and shape, not imported.
    return type(leaf).__name__ == "WithAux" and getattr(leaf, "how", None) is not None


def _base_leaf(fresh: PyTree, given: PyTree, path: str) -> PyTree:
    """given in the form fresh has: quantized as fresh's is (QLoRA), else as it is."""
    if _is_quantized(given) or not _is_quantized(fresh):
        if not _is_quantized(given) and tuple(given.shape) != tuple(_unbox(fresh).shape):
            raise LoraError(f"The base weight {path} has shape {tuple(given.shape)}, but the adapted "
                            f"model's is {tuple(_unbox(fresh).shape)}; start from weights of this model.")
        return given
    import jax
    import jax.numpy as jnp
    from qwix._src.core import qarray

    def quantize(weight: PyTree) -> PyTree:
        return qarray.quantize(weight, fresh.how)

    if LAYERS in path.split("/"):  # a scanned stack: fresh.how is one layer's, so quantize each
        quantize = jax.vmap(quantize)
    return bytewise(fresh.replace(array=quantize(jnp.asarray(given).reshape(fresh.shape))))


def bytewise(tree: PyTree) -> PyTree:
    """tree with 4-bit codes (nf4) held one per byte, as uint8.

    XLA on the CPU lays a uint4 array out packed inside a compiled step but
    unpacked when it is placed, and refuses the mismatch, so the trainer's
    state holds the codes one to a byte (a quarter of float32, as int8);
    qwix reads the codes through its nf4 table whatever their integer type.
    """
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax.core import meta

    def widen(leaf: PyTree) -> PyTree:
        if not _is_quantized(leaf):
            return leaf
        codes = leaf.array.qvalue
        raw = _unbox(codes)
        if raw.dtype != jnp.uint4:
            return leaf
        wide = raw.astype(jnp.uint8)
        codes = codes.replace_boxed(wide) if isinstance(codes, meta.AxisMetadata) else wide
        return leaf.replace(array=dataclasses.replace(leaf.array, qvalue=codes))

    return jax.tree.map(widen, tree, is_leaf=_is_quantized)


def with_base(fresh: Mapping[str, PyTree], given: Mapping[str, PyTree], *,
              heads: tuple[str, ...] = ()) -> dict[str, PyTree]:
    """fresh (an adapted model's variables) with every base weight taken from given.

    given is a base model's variables (no adapters: a Pretrained directory,
    another run's parameters) or an adapted model's; its adapters, where it
    has them, replace fresh's. Its layers may be numbered where fresh's are
    one scanned stack, or the other way round: they are rearranged as
    fresh's. A base weight is quantized as fresh holds it (QLoRA). A base leaf given lacks, or one fresh has no place for, is
    refused by name: a half-loaded base would train silently from noise.
    The objective's heads (top-level parameters it adds, trained in full)
    are taken from given where it has them and kept fresh where it has none.
    """
    import flax.linen as nn

    fresh = nn.meta.unbox(fresh)
    given = nn.meta.unbox(given)
    missing: list[str] = []

    def walk(tree: Mapping[str, PyTree], other: PyTree, prefix: str) -> dict[str, PyTree]:
        other = other if isinstance(other, Mapping) else {}
        out: dict[str, PyTree] = {}
        for key, value in tree.items():
            path = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                out[key] = walk(value, other.get(key), path)
            elif key in other:
                out[key] = other[key] if is_adapter((key,), None) else _base_leaf(value, other[key], path)
            elif is_adapter((key,), None):
                out[key] = value  # a fresh adapter: A drawn, B zero
            else:
                missing.append(path)
        extra = [f"{prefix}/{key}" for key in other if key not in tree]
        if extra:
            raise LoraError(f"The starting weights hold {', '.join(extra[:4])}, which the adapted "
                            "model has no place for; start from weights of the model the recipe builds.")
        return out

    from dew.adapters.lora_stack import laid_out_as

    given_params = given.get("params")
    if isinstance(given_params, Mapping) and isinstance(fresh.get("params"), Mapping):
        params = dict(laid_out_as(given_params, fresh["params"]))  # scanned or numbered
        for head in heads:  # trained in full: as given holds it, else as drawn
            if head in fresh["params"]:
                params.setdefault(head, fresh["params"][head])
        given = {**given, "params": params}
    merged = walk({key: value for key, value in fresh.items() if key == "params"},
                  {key: value for key, value in given.items() if key == "params"}, "")
    if missing:
        raise LoraError(f"The starting weights lack {len(missing)} base weight(s) of the adapted model, "
                        f"first {missing[0]}; LoRA adapts the weights a run starts from: start from weights "
                        "of the model the recipe builds (a recipe's init.run or init.pretrained).")
    return {**fresh, **merged}


def base_shapes(abstract: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """abstract (an adapted model's variables) as the base model's: no adapters, weights in float."""
    import flax.linen as nn
    import jax

    def walk(tree: Mapping[str, PyTree]) -> dict[str, PyTree]:
        out: dict[str, PyTree] = {}
        for key, value in tree.items():
            if isinstance(value, Mapping):
                out[key] = walk(value)
            elif _is_quantized(value):
                scale = _unbox(value.array.scale)
                out[key] = jax.ShapeDtypeStruct(tuple(value.shape), scale.dtype)
            elif not is_adapter((key,), None):
                out[key] = value
        return out

    return walk(nn.meta.unbox(dict(abstract)))


@dataclass(frozen=True)
class BaseWeights:
    """A weight source read for the base model alone, for a run that adds adapters to it.

    source is any ``WeightSource`` (``ParamsFrom`` of a run trained
    without adapters, say); it is asked for the base model's tree, and the
    adapted objective's ``init`` adds fresh adapters (and quantizes a QLoRA
    base).
    """

    source: Callable[[Variables], Variables]

    def __call__(self, abstract: Variables) -> Variables:
        return self.source(base_shapes(abstract))


def base_digest(variables: Mapping[str, PyTree]) -> str:
    """A sha256 of the base weights (every parameter but the adapters): paths, dtypes, shapes, bytes.

    Stored with exported adapters, so that adapters are never put onto a
    base other than the one they were trained on.
    """
    import hashlib

    import flax.linen as nn
    import jax
    import numpy as np

    from dew.adapters.lora_stack import unstack_tree

    digest = hashlib.sha256()
    # A scanned stack is digested as its numbered layers: the same base either way.
    params = unstack_tree(nn.meta.unbox(dict(variables).get("params", variables)))
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    named = sorted(("/".join(str(_digest_part(k)) for k in path), leaf) for path, leaf in flat)
    for name, leaf in named:
        if any(part.endswith(ADAPTER_SUFFIXES) for part in name.split("/")):
            continue
        array = np.asarray(jax.device_get(leaf))
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class _AdaptersOnly(Objective):
    """inner, training its adapters alone; a reference policy is the base model, not a copy.

    ``frozen``, ``init``, ``initializer``, ``loss`` and ``evaluate`` are its
    own; every other declared capability is inner's, and so is any other
    attribute inner has (its fields: ``seq_len``, a ``prompt``).
    """

    def __init__(self, inner: Objective) -> None:
        self.inner = inner
        also = inner.frozen
        heads = {("params", head) for head in inner.heads}

        def frozen(path: tuple[str, ...], leaf: PyTree) -> bool:
            trained = is_adapter(path, leaf) or tuple(path[:2]) in heads  # a head trains in full
            return not trained or (also is not None and bool(also(path, leaf)))

        self.frozen = frozen
        self.ema = inner.ema  # model and tokenizer are inner's too (see __getattr__)

    @property
    def heads(self) -> tuple[str, ...]:  # type: ignore[override]
        """inner's heads, which train in full beside the adapters."""
        return self.inner.heads

    @property
    def _reference(self) -> str | None:
        return self.inner.reference_collection

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        """inner's fresh variables without its reference copy, the base from variables when given."""
        fresh = dict(self.inner.init(key))
        if self._reference is not None:
            fresh.pop(self._reference, None)  # the reference is the base model: see loss
        if variables is not None and self.inner.fills_its_start:  # a distillation's teacher alone, say
            variables = self.inner.init(key, variables)
        return fresh if variables is None else with_base(fresh, variables, heads=self.inner.heads)

    def _with_reference(self, variables: Variables) -> Variables:
        """variables plus the reference as inner reads it: the same base weights, adapters' B at zero."""
        if self._reference is None:
            return variables
        return {**variables, self._reference: base_of(variables["params"])}

    def initializer(self) -> Initializer:
        """inner's starting weights (another run's policy, say), read as the base under the adapters."""
        source = self.inner.initializer()
        return BaseWeights(source) if callable(source) and not isinstance(source, BaseWeights) else source

    def loss(self, variables: Variables, batch: Batch, step: Step) -> tuple[Mean, Aux]:
        return self.inner.loss(self._with_reference(variables), batch, step)

    def evaluate(self, variables: Variables, batch: Batch, step: Step) -> Mapping[str, PyTree]:
        return self.inner.evaluate(self._with_reference(variables), batch, step)

    # -- the rest of what an objective declares is inner's ----------------------------------
    def preview(self, variables: Variables, key: jax.Array) -> Artifact | Sequence[Artifact] | None:
        return self.inner.preview(variables, key)

    def required_keys(self) -> Sequence[str]:
        return self.inner.required_keys()

    def check_batch(self, batch: Mapping[str, np.ndarray], step: int) -> None:
        self.inner.check_batch(batch, step)

    def tokens(self, batch: Mapping[str, jax.ShapeDtypeStruct]) -> int | None:
        return self.inner.tokens(batch)

    def flops(self, batch: Mapping[str, jax.ShapeDtypeStruct]) -> float | None:
        return self.inner.flops(batch)

    def rollout(self) -> Rollout | None:
        return self.inner.rollout()

    def starting_weights(self, source: WeightSource) -> WeightSource:
        return self.inner.starting_weights(source)

    def metrics(self) -> Sequence[Metric]:
        return self.inner.metrics()

    def pipeline(self, state: TrainState | Variables, **options: Any) -> Pipeline:
        return self.inner.pipeline(state, **options)

    @property
    def reference_collection(self) -> str | None:
        return self.inner.reference_collection  # kept out of init: see _reference

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def adapters_only(objective: Objective) -> Objective:
    """objective, training the LoRA adapters alone: every other leaf is frozen.

    The result answers every attribute as objective does, except: ``frozen``
    adds "not an adapter" to objective's own frozen leaves; ``init`` puts
    given base weights under fresh adapters (``with_base``); and an
    objective that keeps a frozen copy of its starting policy (DPO, GRPO:
    its ``reference_collection``) keeps none, its reference being the same
    base weights with the adapters' contribution at zero, exactly the model
    before fine-tuning, without a second copy of the weights.
    """
    return _AdaptersOnly(objective)


def base_of(params: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """params with every adapter's B at zero: the adapted model then computes its base model's function
    (a LoRA run's reference policy, kept without a second copy of the weights)."""
    import jax.numpy as jnp

    return {key: base_of(value) if isinstance(value, Mapping)
            else jnp.zeros_like(value) if str(key).endswith("_lora_b") else value
            for key, value in params.items()}


def merge_lora(variables: Mapping[str, PyTree], spec: Lora) -> dict[str, PyTree]:
    """The base model's variables with each adapter's product added into its weight.

    The result has the base model's tree (no adapters), so the plain model
    (and any exporter of it) computes what the adapted model computes. The
    adapter's A holds the weight's leading (input) dimensions and B its
    trailing ones, as qwix lays them out for dew's layers; in a scanned stack
    (``params/layers``) both carry the layers axis in front, and each layer's
    product is added to its own slice. A routed-experts weight [E, in, out] has
    A [E, in, rank] and B [E, rank, out]: each expert's product goes to its own
    slice. A weight whose adapters do not fit
    that layout is refused.
    """
    import jax
    import jax.numpy as jnp
    from flax.core import meta

    from dew.nn.experts import EXPERT_WEIGHTS

    scale = spec.alpha / spec.rank

    def merge(tree: Mapping[str, PyTree], prefix: str) -> dict[str, PyTree]:
        out: dict[str, PyTree] = {}
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
            if _is_quantized(weight):  # QLoRA: the merged weight is float, the codes' values plus the product
                from qwix._src.core import qarray

                dequantize = jax.vmap(qarray.dequantize) if LAYERS in prefix.split("/") else qarray.dequantize
                weight = dequantize(_unbox_tree(weight.array))
            array = _unbox(weight)
            a, b = (_unbox(x) for x in (a, b))
            if key in EXPERT_WEIGHTS and "router" in tree:  # routed experts: one product per expert
                product = jnp.einsum("...ir,...ro->...io", a, b)
            elif LAYERS in prefix.split("/"):  # inside a scanned stack: one product per layer
                product = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                                     b.reshape(b.shape[0], b.shape[1], -1))
                product = product.reshape(*a.shape[:-1], *b.shape[2:])
            else:
                product = jnp.tensordot(a, b, axes=1)
            if product.size != array.size or product.shape[: a.ndim - 1] != array.shape[: a.ndim - 1]:
                raise LoraError(f"The adapters of {prefix}/{key} (A {a.shape}, B {b.shape}) do not fit "
                                f"its weight of shape {array.shape}; they cannot be merged.")
            merged = (array + scale * product.reshape(array.shape)).astype(array.dtype)
            out[key] = weight.replace_boxed(merged) if isinstance(weight, meta.AxisMetadata) else merged
        return out

    return merge(variables, "")
