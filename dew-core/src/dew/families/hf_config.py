"""Reading and writing the parts of a Hugging Face ``config.json`` every family shares.

transformers 4 wrote the rotary settings at the top level (``rope_theta``,
``rope_scaling``, ``partial_rotary_factor``) and the weights' type as
``torch_dtype``; transformers 5 writes ``rope_parameters`` and ``dtype``.
Both are read here the way transformers 5 reads them (a ``rope_scaling``
that is set wins over ``rope_parameters``; a missing ``rope_theta`` comes
from the top level), so either layout loads as the same model. What dew
writes carries both, so either version reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.nn.rotary import ROPE_KINDS, RopeScaling
from dew.pretrained.errors import NoExactCounterpartError

if TYPE_CHECKING:
    from flax.linen import Module

__all__ = [
    "DTYPES",
    "common_config",
    "common_fields",
    "dtype_name",
    "flat_rope_config",
    "layer_types",
    "number",
    "one_window",
    "listed_window",
    "refuse",
    "rope_config",
    "rope_fields",
    "rope_parameters",
    "sliding_layers",
    "stored_dtype",
    "training_settings",
    "window_fields",
]

# config.json keys that say how transformers trains a model, not what it computes: a directory's
# own values are written back over the family's defaults (Pretrained.training). Phi-3's
# original_max_position_embeddings too: without rotary scaling it computes nothing, and with it the
# model was read from that value, so the directory's own is written back rather than the decode cache's.
TRAINING_KEYS = ("router_aux_loss_coef", "output_router_logits", "router_jitter_noise", "initializer_range",
                 "attention_dropout", "original_max_position_embeddings")

DTYPES = ("float32", "bfloat16", "float16")


def refuse(architecture: str, field: str, value: Any, supported: str) -> NoExactCounterpartError:
    """The error for a config.json value dew has no exact counterpart for, naming the field."""
    return NoExactCounterpartError(
        f"{architecture} config.json sets {field}={value!r}, which dew's decoder has no exact "
        f"counterpart for ({supported}); dew refuses it rather than compute something else.")


def rope_parameters(config: Mapping[str, Any], nested: str | None = None) -> tuple[dict[str, Any], str]:
    """The rotary settings as transformers 5 reads them, and the field they came from."""
    if nested is not None:  # Gemma 3: one dict per layer type
        field = f"rope_parameters.{nested}"
        return dict((config.get("rope_parameters") or {}).get(nested) or {}), field
    scaling = config.get("rope_scaling")
    if scaling:
        return dict(scaling), "rope_scaling"
    return dict(config.get("rope_parameters") or {}), "rope_parameters"


def rope_fields(config: Mapping[str, Any], architecture: str, params: Mapping[str, Any], field: str,
                *, theta: float, partial: bool = False) -> dict[str, Any]:
    """rope_base, rope_scaling and rotary_fraction from one dict of rotary settings.

    theta is the family's default base, used when neither the dict nor the
    top level of config names one. partial: the family's transformers class
    rotates only ``partial_rotary_factor`` of each head (Phi-3); the others
    rotate the whole head whatever the key says, and so does dew for them.
    """
    kind: Any = params.get("rope_type") or params.get("type") or "default"  # a config.json value
    base = float(params.get("rope_theta", config.get("rope_theta", theta)))
    fraction = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)
    if not partial and fraction != 1.0 and kind != "default":  # transformers fails on it: fewer frequencies
        raise refuse(architecture, "partial_rotary_factor", fraction,  # than the head it rotates whole
                     f"{architecture} rotates the whole head, and with rope type {kind!r} transformers cannot "
                     "compute this model either; remove partial_rotary_factor from a copy of config.json")
    out: dict[str, Any] = {"rope_base": base, "rotary_fraction": fraction if partial else 1.0, "rope_scaling": None}
    if kind == "default":
        return out
    if kind not in ROPE_KINDS:
        error = refuse(architecture, f"{field}.rope_type", kind,
                       f"it computes the rope types 'default', {', '.join(map(repr, ROPE_KINDS))}")
        if kind == "dynamic":  # transformers rescales only past the original length
            error = NoExactCounterpartError(
                f"{error} Dynamic scaling is the default rope up to the length the checkpoint was "
                "trained at: for contexts that short, remove rope_scaling from a copy of config.json.")
        raise error
    # transformers prefers the top level's original length to the one beside the rope settings (Phi-3
    # writes it there), and falls back to the published context
    original: Any = (config.get("original_max_position_embeddings")
                     or params.get("original_max_position_embeddings")
                     or config.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = float(config["max_position_embeddings"]) / float(original)
    if factor is None:
        raise refuse(architecture, f"{field}.factor", None, f"rope type {kind!r} needs a factor")
    numbers = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "beta_fast": "beta_fast", "beta_slow": "beta_slow",
               "attention_factor": "attention_factor", "mscale": "mscale",
               "mscale_all_dim": "mscale_all_dim"}
    extra: dict[str, Any] = {mine: float(params[theirs]) for mine, theirs in numbers.items()
                             if params.get(theirs) is not None}
    if kind in ("llama3", "yarn", "longrope"):
        extra["original_max_len"] = int(original)
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            values = params.get(name)
            if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
                raise refuse(architecture, f"{field}.{name}", values, "LongRoPE needs a list of numbers there")
            extra[name] = tuple(float(v) for v in values)
    if kind == "yarn":
        extra["truncate"] = bool(params.get("truncate", True))
    try:
        out["rope_scaling"] = RopeScaling(kind, float(factor), **extra)
    except ValueError as error:
        raise refuse(architecture, field, dict(params), str(error)) from None
    return out


def rope_config(base: float, scaling: RopeScaling | None, fraction: float = 1.0) -> dict[str, Any]:
    """One dict of rotary settings in transformers 5's form (``rope_type``, ``rope_theta``, ...)."""
    params: dict[str, Any] = {"rope_type": "default" if scaling is None else scaling.kind,
                              "rope_theta": float(base)}
    if fraction != 1.0:
        params["partial_rotary_factor"] = float(fraction)
    if scaling is None:
        return params
    params["factor"] = float(scaling.factor)
    names = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
             "original_max_len": "original_max_position_embeddings", "beta_fast": "beta_fast",
             "beta_slow": "beta_slow", "attention_factor": "attention_factor", "mscale": "mscale",
             "mscale_all_dim": "mscale_all_dim"}
    for mine, theirs in names.items():
        value = getattr(scaling, mine)
        if value is not None:
            params[theirs] = value
    if scaling.kind == "yarn" and not scaling.truncate:
        params["truncate"] = False
    if scaling.kind == "longrope":
        params["short_factor"] = [number(v) for v in scaling.short_factor or ()]
        params["long_factor"] = [number(v) for v in scaling.long_factor or ()]
    return params


def stored_dtype(config: Mapping[str, Any]) -> str:
    """The weights' type config.json records (``dtype`` or ``torch_dtype``; float32 if neither)."""
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(stored).removeprefix("torch.")


def dtype_name(dtype: Any) -> str:
    """A numpy/jax dtype as config.json names it; refuse one transformers has no name for."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise NoExactCounterpartError(
            f"CausalTransformer.param_dtype={name} has no Hugging Face counterpart; use "
            f"{', '.join(DTYPES)}.")
    return name


def common_fields(config: Mapping[str, Any], *, tie_default: bool = False) -> dict[str, Any]:
    """The CausalTransformer fields every dense family reads the same way (config completed with the
    family's defaults: a head width or key-value head count left out is the family's own)."""
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim") or hidden // heads
    tie = config.get("tie_word_embeddings")
    return {
        "vocab_size": int(config["vocab_size"]),
        "emb_features": hidden,
        "num_layers": int(config["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": None if kv_heads == heads else kv_heads,
        "mlp_features": int(config["intermediate_size"]),
        "head_features": None if int(head_dim) * heads == hidden else int(head_dim),
        "position_embedding": "rotary",
        "tie_embeddings": tie_default if tie is None else bool(tie),
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
    }


def common_config(model: Module, architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json keys every dense family writes the same way."""
    name = dtype_name(model.param_dtype)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_features,
        "intermediate_size": model.mlp_features,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads or model.num_heads,
        "head_dim": model.head_width,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_epsilon,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": name,
        "torch_dtype": name,
    }


def flat_rope_config(model: Module) -> dict[str, Any]:
    """Top-level rotary keys (transformers 4) and ``rope_parameters`` (5) for one global rope."""
    params = rope_config(model.rope_base, model.rope_scaling, model.rotary_fraction)
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    out: dict[str, Any] = {
        "rope_theta": float(model.rope_base),
        "rope_scaling": None if model.rope_scaling is None else scaling,
        "rope_parameters": params,
    }
    if model.rotary_fraction != 1.0:
        out["partial_rotary_factor"] = float(model.rotary_fraction)
    return out


def number(value: float | None) -> float | int | None:
    """value as config.json writes it: an integer when it is whole (transformers checks types)."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else float(value)


def sliding_layers(types: list[str] | None) -> tuple[int, ...] | None:
    """The layers a ``layer_types`` list gives a sliding window (None: no list)."""
    if types is None:
        return None
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def layer_types(model: Module) -> list[str]:
    """``layer_types`` as transformers writes it: each layer sliding_attention or full_attention."""
    return ["sliding_attention" if window is not None else "full_attention"
            for window, _, _ in model._layer_parts()]


def one_window(model: Module) -> int | None:
    """The window a config.json that names one for every layer writes for model: its layers' one
    window (None: none), else model.sliding_window, which reads back as another pattern and so is
    refused by Family.config, naming the field."""
    windows = {window for window, _, _ in model._layer_parts()}
    return next(iter(windows)) if len(windows) == 1 else model.sliding_window


def listed_window(model: Module) -> int:
    """The sliding_window a config.json beside a layer_types list writes for model (Gemma 2 and 3):
    its window, or, where no layer slides, the context, which the list's full_attention layers never
    read. transformers builds those families' sliding mask whatever the list says, and refuses a
    window of null, so a model without one is written with a window that changes nothing."""
    return model.max_seq_len if model.sliding_window is None else model.sliding_window


def window_fields(window: int | None, layers: tuple[int, ...] | None, count: int) -> dict[str, Any]:
    """sliding_window and sliding_layers, with None for 'no window' and for 'every layer'."""
    if window is None or layers == ():
        return {"sliding_window": None, "sliding_layers": None}
    if layers is not None and tuple(layers) == tuple(range(count)):
        layers = None
    return {"sliding_window": int(window), "sliding_layers": None if layers is None else tuple(layers)}


def training_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The training keys (TRAINING_KEYS) config.json gives."""
    return {key: config[key] for key in TRAINING_KEYS if key in config}
