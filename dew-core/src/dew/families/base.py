"""A family: a preset of dew's decoder parts plus one converter, and the table of families.

A :class:`Family` says how its ``config.json`` reads as CausalTransformer
fields (``read``) and back (``write``), which tensors its checkpoints hold
(the converter table of ``dew.families.convert``), and the configurations
of its published sizes (``presets``, config-only: nothing is downloaded).
Every family computes with the same decoder; a family is data, not code.

What ``write`` produces is checked by reading it back: a model whose parts
the family's config.json cannot say exactly is refused, naming the field,
never exported approximately.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dew.errors import DewKeyError
from dew.families import scoring
from dew.families.convert import Entry, dense_table
from dew.families.hf_config import stored_dtype
from dew.pretrained.errors import (
    ConfigurationMismatchError,
    NoExactCounterpartError,
    UnsupportedArchitectureError,
)

if TYPE_CHECKING:
    from flax.linen import Module
    from jax.typing import DTypeLike

__all__ = [
    "FAMILIES",
    "RUNTIME_FIELDS",
    "Family",
    "architectures",
    "builder",
    "check_same_function",
    "family",
    "for_config",
    "function_fields",
    "of_model",
]

# name -> module: each module defines FAMILY. Importing one imports nothing else.
FAMILIES: Mapping[str, str] = {
    "llama": "dew.families.llama",
    "mistral": "dew.families.mistral",
    "qwen2": "dew.families.qwen2",
    "qwen3": "dew.families.qwen3",
    "gemma": "dew.families.gemma",
    "gemma2": "dew.families.gemma2",
    "gemma3": "dew.families.gemma3",
    "phi3": "dew.families.phi3",
    "olmo2": "dew.families.olmo2",
    "mixtral": "dew.families.mixtral",
    "qwen2_moe": "dew.families.qwen2_moe",
    "qwen3_moe": "dew.families.qwen3_moe",
    "deepseek_v3": "dew.families.deepseek_v3",
}

# The layout a CausalTransformer whose family is None is written in.
DEFAULT = "llama"

# Fields that change how a model runs, not what it computes.
RUNTIME_FIELDS = frozenset({"max_seq_len", "dtype", "param_dtype", "attention", "remat", "scan_layers",
                            "family", "parent", "name"})

# dew field -> the config.json key it mirrors, for messages.
MIRRORED = {
    "vocab_size": "vocab_size",
    "emb_features": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "mlp_features": "intermediate_size",
    "head_width": "head_dim",
    "mlp_activation": "hidden_act",
    "tie_embeddings": "tie_word_embeddings",
    "rope_base": "rope_theta",
    "norm_epsilon": "rms_norm_eps",
    "sliding_window": "sliding_window",
    "attention_softcap": "attn_logit_softcapping",
    "logit_softcap": "final_logit_softcapping",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
}


@dataclass(frozen=True)
class Family:
    """A published decoder architecture: how its config.json and tensors map onto dew's decoder.

    read maps a config.json to CausalTransformer fields (refusing values with
    no exact counterpart, naming the field); write maps a model to the
    config.json keys of this family; presets hold the config.json values of
    published sizes; checkpoints says, for the documentation, which
    published checkpoints the family covers.
    """

    name: str
    architecture: str
    model_type: str
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    write: Callable[[Module], dict[str, Any]]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    fused: bool = False
    also_reads: tuple[str, ...] = ()
    checkpoints: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """transformers' defaults for this family's config.json keys that read uses, so a
    config.json that leaves one out reads as transformers reads it (Phi-3's norm epsilon is
    1e-5, Mistral's window 4096), not as another family's value."""
    unread: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda config: ()
    """The name prefixes of tensors a checkpoint of this config holds that the model does not
    compute (DeepSeek-V3's multi-token-prediction layer): left unread, as transformers leaves them."""

    @property
    def architectures(self) -> tuple[str, ...]:
        """The ``architectures`` names this family reads (the first is the one it writes)."""
        return (self.architecture, *self.also_reads)

    def table(self, model: Module) -> dict[str, Entry]:
        """The converter table of model in this family's layout."""
        return dense_table(model, fuse=self.fused)

    @property
    def label(self) -> str | None:
        """What a model of this family holds in its ``family`` field (None for Llama, the default)."""
        return None if self.name == DEFAULT else self.name

    def fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The CausalTransformer fields config.json describes (family set; runtime fields left out)."""
        return {**self.read(self.completed(config)), "family": self.label}

    def completed(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """config with transformers' defaults for the keys it leaves out (an explicit null stays)."""
        return {**self.defaults, **config}

    def context(self, config: Mapping[str, Any]) -> int | None:
        """The context length config.json gives the weights (max_position_embeddings, or this
        family's default for it; None when neither says)."""
        length = self.completed(config).get("max_position_embeddings")
        return None if length is None else int(length)

    def model(self, config: Mapping[str, Any], *, max_seq_len: int | None = None,
              param_dtype: DTypeLike | None = None, dtype: DTypeLike | None = None) -> Module:
        """The CausalTransformer config.json describes, in param_dtype (default: as stored)."""
        import jax.numpy as jnp

        from dew.nn.backbones import CausalTransformer

        kinds = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
        stored = kinds.get(stored_dtype(config), jnp.float32)
        param_dtype = kinds.get(jnp.dtype(param_dtype or stored).name, jnp.float32)
        dtype = kinds.get(jnp.dtype(dtype).name) if dtype is not None else param_dtype
        return CausalTransformer(
            **self.fields(config),
            max_seq_len=int(max_seq_len or self.context(config) or 2048),
            dtype=dtype, param_dtype=param_dtype)

    def config(self, model: Module) -> dict[str, Any]:
        """model's config.json in this family's layout; refuses a part it cannot express."""
        _check_decoder(model, self)
        written = self.write(model)
        try:
            back = self.fields(written)
        except NoExactCounterpartError as error:
            raise NoExactCounterpartError(f"{self.architecture} cannot express this model: {error}") from None
        again = _rebuilt(model, back)
        mine, theirs = function_fields(model), function_fields(again)
        for name, value in mine.items():
            if theirs.get(name) != value:
                hint = _fitting(model, self)
                raise NoExactCounterpartError(
                    f"CausalTransformer.{_field(name)}={_value(model, name)!r} has no exact counterpart "
                    f"in {self.architecture} (its config.json would make it {_value(again, name)!r}). "
                    f"Only a model built with this family's parts exports as {self.name}; dew never "
                    f"exports approximately.{hint}")
        return written

    def preset(self, name: str) -> dict[str, Any]:
        """The config.json values of a published size; PresetError lists the sizes there are."""
        if name not in self.presets:
            raise PresetError(f"The {self.name} family has no preset {name!r}; its presets are "
                              f"{', '.join(map(repr, self.presets))}.")
        return dict(self.presets[name])

    def build(self, preset: str | None = None, **fields: Any) -> Module:
        """A CausalTransformer of this family: a preset's configuration, then fields over it.

        A num_layers given here also re-derives the layers' sliding pattern
        the preset's configuration implies, unless sliding_layers is given.
        """
        from dew.nn.backbones import CausalTransformer

        given = self._configured(preset, fields)
        problems = CausalTransformer.field_problems(given)  # refused when built, not at the first trace
        if problems:
            raise ValueError(problems[0][1])
        return CausalTransformer(**given)

    def field_problems(self, fields: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
        """What build would refuse in a recipe's fields (an unknown preset, values the decoder
        refuses), said before anything is built (dew.registry.ChecksFields)."""
        from dew.nn.backbones import CausalTransformer

        given = dict(fields)
        try:
            configured = self._configured(given.pop("preset", None), given)
        except PresetError as error:
            return [(("preset",), str(error))]
        return CausalTransformer.field_problems(configured)

    def _configured(self, preset: str | None, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The CausalTransformer fields of preset (the first when None) with fields over them."""
        config = self.preset(preset or next(iter(self.presets)))
        if "num_layers" in fields:
            config["num_hidden_layers"] = fields["num_layers"]
            config.pop("layer_types", None)
        built = {**self.fields(config), "max_seq_len": int(config.get("max_position_embeddings", 2048))}
        return {**built, "family": self.label, **fields}


class PresetError(NoExactCounterpartError, DewKeyError):
    """A family asked for a preset it does not have."""


def _rebuilt(model: Module, fields: Mapping[str, Any]) -> Module:
    """A CausalTransformer of fields alone (every other field at its default), model's runtime kept."""
    from dew.nn.backbones import CausalTransformer

    runtime = {f: getattr(model, f) for f in ("max_seq_len", "dtype", "param_dtype")}
    return CausalTransformer(**{**fields, **runtime})


def _field(name: str) -> str:
    return {"kv_heads": "num_kv_heads", "head_width": "head_features",
            "layers": "sliding_window"}.get(name, name)


def _value(model: Module, name: str) -> Any:
    return function_fields(model).get(name)


def _check_decoder(model: Module, target: Family) -> None:
    from dew.nn.backbones import CausalTransformer

    if type(model) is not CausalTransformer:
        raise NoExactCounterpartError(
            f"Only dew's CausalTransformer has a Hugging Face counterpart ({target.architecture}); "
            f"got {type(model).__module__}.{type(model).__qualname__}. Export it in dew's own layout "
            "(dew export without --format hf; format='dew' from Python); a quantized or wrapped language "
            "model exports through the CausalTransformer it wraps.")
    model._check()


def _fitting(model: Module, tried: Family) -> str:
    """A hint naming the families whose config.json does express model, if any."""
    fits = []
    for name in FAMILIES:
        if name == tried.name:
            continue
        other = family(name)
        try:
            again = _rebuilt(model, other.fields(other.write(model)))
        except Exception:  # noqa: BLE001 - any refusal means it does not fit
            continue
        if function_fields(again) == function_fields(model):
            fits.append(name)
    if not fits:
        return ""
    return f" It does fit {', '.join(fits)}: set CausalTransformer.family to {fits[0]!r}."


def function_fields(model: Module) -> dict[str, Any]:
    """What decides the function a CausalTransformer computes, normalized for comparison.

    The head width and key/value heads as counts; each layer's sliding
    window, rotary base and scaling as one list (``layers``); runtime
    fields (dtype, max_seq_len, remat, ...) and the family name left out.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(model):
        if f.name in RUNTIME_FIELDS or f.name in ("head_features", "num_kv_heads", "sliding_window",
                                                  "sliding_layers", "local_rope_base"):
            continue
        out[f.name] = getattr(model, f.name)
    if not model.experts:
        out.pop("experts_per_token", None)
        out.pop("expert_capacity", None)
    elif model.mlp_block == "routed" and model.routing is not None:
        # How the grouped matmuls run is a runtime choice; dropless routing never reads the capacity.
        out["routing"] = dataclasses.replace(model.routing, grouped_matmul="auto")
        if model.routing.dropless:
            out.pop("expert_capacity", None)
    out["head_width"] = model.head_width
    out["kv_heads"] = model.num_kv_heads or model.num_heads
    parts = model._layer_parts()
    windows = sorted({w for w, _, _ in parts if w is not None})
    out["sliding_window"] = windows[0] if len(windows) == 1 else (windows or None)
    out["layers"] = parts  # last: a difference in any of the above shows first by its own name
    return out


def check_same_function(model: Module, loaded: Module, source: str, *, prefix: str = "model.") -> None:
    """Refuse to start model from loaded's weights unless both compute the same function.

    Shapes alone would let a different rope_theta or norm epsilon through,
    which gives the same tensors another meaning. The message names the first
    field that differs and the override that fixes it (the recipe's fields
    under prefix), written so it can be pasted into a shell; when the
    checkpoint is another family's, it names the family first, since every
    one of its fields would differ in turn.
    """
    mine, theirs = function_fields(model), function_fields(loaded)
    for name, value in theirs.items():
        if mine.get(name) == value:
            continue
        written, building = of_model(loaded), of_model(model)
        if written.name != building.name:
            raise ConfigurationMismatchError(
                f"{source} holds a {written.architecture} checkpoint (the {written.name} family), but "
                f"the model to start from it is a {building.name} model, which computes another "
                f"function ({'layers' if name == 'layers' else _field(name)}: {_shown(value)} there, "
                f"{_shown(mine.get(name))} here). Set {_set(prefix, 'name', written.name)} and "
                f"{prefix}preset to the checkpoint's size (the {written.name} presets: "
                f"{', '.join(written.presets)}) so the weights mean what they meant.")
        if name == "layers":
            raise ConfigurationMismatchError(
                f"{source} was trained with these layers (sliding window, rotary base, rotary "
                f"scaling) {_shown(value)}, but the model to start from it has {_shown(mine.get(name))}. "
                f"Set {_layers_setting(prefix, model, loaded)} so the weights mean what they meant.")
        key = MIRRORED.get(name)
        mirrored = f" ({key} in its config.json)" if key else ""
        shown = {"kv_heads": "kv_heads", "head_width": "head_width"}.get(name, _field(name))
        # Several fields apart: another size of the family, named as one setting rather than a field a run.
        apart = sum(mine.get(other) != theirs[other] for other in theirs if other != "layers")  # layers mirror
        size = _preset_of(written, loaded) if apart > 1 else None
        fix = (f"Set {_set(prefix, 'preset', size)}, the {written.name} size the checkpoint is," if size is not None
               else f"Set {_set(prefix, _field(name), _setting(loaded, name))}")
        raise ConfigurationMismatchError(
            f"{source} was trained with {shown}={_shown(value)}{mirrored}, but the model to start "
            f"from it has {_shown(mine.get(name))}. {fix} so the weights mean what they meant.")


def _preset_of(family: Family, loaded: Module) -> str | None:
    """The name of family's preset whose model computes loaded's function, if one does."""
    theirs = function_fields(loaded)
    for name, config in family.presets.items():
        try:
            built = family.model(config, max_seq_len=loaded.max_seq_len)
        except (TypeError, ValueError, KeyError):  # a preset this checkout cannot build: not the one
            continue
        if function_fields(built) == theirs:
            return name
    return None


def _setting(model: Module, name: str) -> Any:
    if name in ("kv_heads", "head_width"):
        return function_fields(model)[name]
    return getattr(model, name)


def _set(prefix: str, field: str, value: Any) -> str:
    """One ``key=value`` override, quoted for a shell when it needs to be."""
    import shlex

    return shlex.quote(f"{prefix}{field}={_override(value)}")


def _layers_setting(prefix: str, model: Module, loaded: Module) -> str:
    """The overrides that give model loaded's layers: the windows and the layers they cover, or
    the layers' rotary bases and scaling."""
    parts = loaded._layer_parts()
    if [w for w, _, _ in model._layer_parts()] != [w for w, _, _ in parts]:
        windowed = [i for i, (w, _, _) in enumerate(parts) if w is not None]
        if not windowed:
            return _set(prefix, "sliding_window", None)
        layers = None if len(windowed) == len(parts) else windowed
        return (f"{_set(prefix, 'sliding_window', loaded.sliding_window)} and "
                f"{_set(prefix, 'sliding_layers', layers)}")
    return (f"{_set(prefix, 'rope_base', loaded.rope_base)}, "
            f"{_set(prefix, 'local_rope_base', loaded.local_rope_base)} and "
            f"{_set(prefix, 'rope_scaling', loaded.rope_scaling)}")


def _override(value: Any) -> str:
    """value as a ``key=value`` override writes it (YAML): a dataclass as a mapping of the fields
    that differ from their defaults, so a hint can be pasted as it is printed.

    >>> from dew.nn.rotary import RopeScaling
    >>> _override(RopeScaling("yarn", 4.0, original_max_len=64))
    '{kind: yarn, factor: 4.0, original_max_len: 64}'
    >>> _override((1, 2)), _override(None), _override(False)
    ('[1,2]', 'null', 'false')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        given = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
                 if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default]
        return "{" + ", ".join(f"{name}: {_override(v)}" for name, v in given) + "}"
    if isinstance(value, tuple | list):
        return "[" + ",".join(_override(v) for v in value) + "]"
    return str(value)


def _shown(value: Any) -> str:
    return _override(value) if isinstance(value, tuple | list) or dataclasses.is_dataclass(value) else repr(value)


def family(name: str) -> Family:
    """The family called name (``"qwen3"``); UnsupportedArchitectureError lists the others."""
    if name not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"dew has no model family {name!r}; the families are {', '.join(FAMILIES)}.")
    return importlib.import_module(FAMILIES[name]).FAMILY


def architectures() -> dict[str, str]:
    """Every architecture name dew reads, with the family that reads it."""
    return {arch: name for name in FAMILIES for arch in family(name).architectures}


def for_config(config: Mapping[str, Any]) -> Family:
    """The family a config.json belongs to, by its ``architectures`` (else its ``model_type``)."""
    given = config.get("architectures") or []
    if isinstance(given, str):  # one name written bare: that name, not its letters
        given = [given]
    if not isinstance(given, list | tuple):
        raise UnsupportedArchitectureError(
            f"The checkpoint's config.json gives architectures {given!r}; it is a list of model class names "
            "(such as [\"LlamaForCausalLM\"]), as transformers writes it.")
    named = [str(arch) for arch in given]
    kind = config.get("model_type")
    if isinstance(kind, str) and kind in FAMILIES and named:  # the usual case, without importing every family
        own = family(kind).architectures
        if named[0] in own or named[0] in map(scoring.architecture, own):
            return family(kind)
    covered = architectures()
    scorers = {scoring.architecture(arch): arch for arch in covered}  # a reward model: its decoder's family
    for arch in named:
        if scorers.get(arch, arch) in covered:
            return family(covered[scorers.get(arch, arch)])
    if not named:
        for name in FAMILIES:
            if family(name).model_type == kind:
                return family(name)
    what = ", ".join(named) or f"model_type {kind!r}"
    raise UnsupportedArchitectureError(
        f"The checkpoint is a {what}; dew loads {', '.join(covered)} "
        f"(the families {', '.join(FAMILIES)}), and each one's ForSequenceClassification with one label "
        "(a reward model).")


def of_model(model: Module) -> Family:
    """The family model is written as: its ``family`` field, or Llama when it names none."""
    return family(getattr(model, "family", None) or DEFAULT)  # any flax Module: dew's decoders name theirs


def builder(name: str) -> Callable[..., Any]:
    """The function ``models.build(name, ...)`` calls: a preset, then CausalTransformer fields over it.

    Its signature declares ``preset`` and every CausalTransformer field (each
    optional: left out, it comes from the preset), so the registry checks a
    recipe's fields by name and type before anything is built.
    """
    import inspect
    import typing

    from dew.nn.backbones import CausalTransformer

    def build(**fields: Any) -> Any:
        return family(name).build(**fields)

    hints = typing.get_type_hints(CausalTransformer)
    parameters = [inspect.Parameter("preset", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=str | None)]
    for f in dataclasses.fields(CausalTransformer):
        if f.name in RUNTIME_FIELDS - {"max_seq_len", "dtype", "param_dtype", "attention", "remat",
                                        "scan_layers"}:
            continue
        parameters.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=hints[f.name] | None))
    build.__signature__ = inspect.Signature(parameters, return_annotation=CausalTransformer)  # type: ignore[attr-defined]
    build.__annotations__ = {p.name: p.annotation for p in parameters}
    build.__name__ = build.__qualname__ = name
    build.field_problems = family(name).field_problems  # type: ignore[attr-defined]  # dew.registry.ChecksFields
    made = family(name)
    build.__doc__ = (f"A CausalTransformer of the {name} family ({made.architecture}): ``preset``, one "
                     f"of {', '.join(made.presets)} (default {next(iter(made.presets))}), and "
                     "CausalTransformer fields over it.")
    return build
