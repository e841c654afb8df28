"""CausalTransformer as Hugging Face's Llama, parameter for parameter.

The two are the same function when the dew model uses rotary positions,
SwiGLU and RMSNorm without biases: dew's rotary pairs feature i with
feature i + head_dim/2, which is Llama's ``rotate_half`` convention with
frequencies ``rope_theta ** (-2i / head_dim)``, so no permutation of the
query and key columns is needed; query head h reads key/value head
``h // (heads / kv_heads)`` in both; the attention scale is 1/sqrt(head_dim)
in both. Only layouts differ: dew keeps kernels as [in, out] (attention as
[embed, heads, head_dim] and [heads, head_dim, embed]), torch's Linear as
[out, in]. Every move below is a transpose or a reshape, so a round trip is
bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dew.pretrained.errors import (
    ConfigurationMismatchError,
    NoExactCounterpartError,
    UnsupportedArchitectureError,
)

__all__ = [
    "ARCHITECTURE",
    "SUPPORTED",
    "Tensor",
    "check_same_function",
    "config_to_model",
    "model_to_config",
    "tensors",
]

# dew's field -> the config.json key it mirrors, for the fields that decide the function.
MIRRORED = {
    "vocab_size": "vocab_size",
    "emb_features": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "mlp_features": "intermediate_size",
    "head_width": "head_dim",
    "position_embedding": None,
    "mlp_activation": "hidden_act",
    "tie_embeddings": "tie_word_embeddings",
    "rope_base": "rope_theta",
    "norm_epsilon": "rms_norm_eps",
}

ARCHITECTURE = "LlamaForCausalLM"
SUPPORTED = (ARCHITECTURE,)
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor: where it lives in dew's params and how its layout converts."""

    path: tuple[str, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]
    dew_shape: tuple[int, ...]
    hf_shape: tuple[int, ...]


def _same(array: np.ndarray) -> np.ndarray:
    return array


def _transpose(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array.T)


def _dtype_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise NoExactCounterpartError(
            f"CausalTransformer.param_dtype={name} has no Hugging Face counterpart; use float32, "
            "bfloat16 or float16."
        )
    return _DTYPES[name]


def model_to_config(model: Any, *, eos_id: int | None = None, bos_id: int | None = None) -> dict:
    """The config.json of LlamaForCausalLM for model; refuse fields with no exact counterpart."""
    from dew.nn.backbones import CausalTransformer

    if type(model) is not CausalTransformer:
        raise NoExactCounterpartError(
            f"Only dew's CausalTransformer has a Hugging Face counterpart (LlamaForCausalLM); "
            f"got {type(model).__module__}.{type(model).__qualname__}. A quantized or wrapped "
            "model exports through the CausalTransformer it wraps."
        )
    model._check()
    exact = {
        "position_embedding": ("rotary", "Llama has no learned position table"),
        "mlp_activation": ("swiglu", "Llama's feed-forward block is SwiGLU (silu-gated)"),
        "experts": (0, "Llama's feed-forward block is dense, not a mixture of experts"),
    }
    for field, (needed, why) in exact.items():
        value = getattr(model, field)
        if value != needed:
            raise NoExactCounterpartError(
                f"CausalTransformer.{field}={value!r} has no exact counterpart in "
                f"{ARCHITECTURE}: {why}. Only a model built with {field}={needed!r} exports; "
                "dew never exports approximately."
            )
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_features,
        "intermediate_size": model.mlp_features,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads or model.num_heads,
        "head_dim": model.head_width,
        "max_position_embeddings": model.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rope_base,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": _dtype_name(model.param_dtype),
    }
    if eos_id is not None:
        config["eos_token_id"] = int(eos_id)
    if bos_id is not None:
        config["bos_token_id"] = int(bos_id)
    return config


def _rope(config: Mapping[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default"):
        raise NoExactCounterpartError(
            f"rope_scaling/rope_parameters of type {kind!r} has no counterpart in dew's "
            "CausalTransformer, whose rotary frequencies are rope_theta ** (-2i/head_dim) only."
        )
    theta = parameters.get("rope_theta", config.get("rope_theta", 10_000.0))
    return float(theta)


def config_to_model(config: Mapping[str, Any], *, max_seq_len: int | None = None,
                    param_dtype: Any = None, dtype: Any = None) -> Any:
    """The CausalTransformer that config.json describes; refuse what it cannot express."""
    import jax.numpy as jnp

    from dew.nn.backbones import CausalTransformer

    architectures = list(config.get("architectures") or [])
    kind = config.get("model_type")
    if ARCHITECTURE not in architectures and not (not architectures and kind == "llama"):
        named = ", ".join(architectures) or f"model_type {kind!r}"
        raise UnsupportedArchitectureError(
            f"The checkpoint is a {named}; dew loads {', '.join(SUPPORTED)} (model_type "
            "'llama') only."
        )
    refused = {
        "hidden_act": ("silu", config.get("hidden_act", "silu")),
        "attention_bias": (False, bool(config.get("attention_bias", False))),
        "mlp_bias": (False, bool(config.get("mlp_bias", False))),
    }
    for field, (needed, value) in refused.items():
        if value != needed:
            raise NoExactCounterpartError(
                f"config.json sets {field}={value!r}; dew's CausalTransformer needs {needed!r} "
                "to compute the same function, so it does not load this checkpoint."
            )
    rope_base = _rope(config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim") or hidden // heads
    kinds = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    param_dtype = kinds.get(jnp.dtype(param_dtype or kinds.get(str(stored), jnp.float32)).name)
    dtype = kinds.get(jnp.dtype(dtype).name) if dtype is not None else None
    return CausalTransformer(
        vocab_size=int(config["vocab_size"]),
        emb_features=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=None if kv_heads == heads else kv_heads,
        mlp_features=int(config["intermediate_size"]),
        max_seq_len=int(max_seq_len or config.get("max_position_embeddings", 2048)),
        head_features=None if int(head_dim) * heads == hidden else int(head_dim),
        position_embedding="rotary",
        mlp_activation="swiglu",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_base=rope_base,
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        dtype=dtype or param_dtype,
        param_dtype=param_dtype,
    )


def tensors(model: Any) -> dict[str, Tensor]:
    """Every LlamaForCausalLM tensor name of model, with its dew path and conversions."""
    embed, mlp, vocab = model.emb_features, model.mlp_features, model.vocab_size
    heads, kv_heads, width = model.num_heads, model.num_kv_heads or model.num_heads, model.head_width

    def projection(count: int) -> tuple[Callable, Callable]:
        return (lambda a: _transpose(a.reshape(embed, count * width)),
                lambda w: np.ascontiguousarray(w.T).reshape(embed, count, width))

    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": Tensor(("embed", "embedding"), _same, _same, (vocab, embed),
                                            (vocab, embed)),
        "model.norm.weight": Tensor(("final_norm", "scale"), _same, _same, (embed,), (embed,)),
    }
    if not model.tie_embeddings:
        out["lm_head.weight"] = Tensor(("head",), _transpose, _transpose, (embed, vocab),
                                   (vocab, embed))
    for i in range(model.num_layers):
        hf, dew = f"model.layers.{i}", f"layers_{i}"
        for name, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            kind = {"q": "query", "k": "key", "v": "value"}[name]
            to_hf, from_hf = projection(count)
            out[f"{hf}.self_attn.{name}_proj.weight"] = Tensor(
                (dew, "attention", kind), to_hf, from_hf, (embed, count, width),
                (count * width, embed))
        out[f"{hf}.self_attn.o_proj.weight"] = Tensor(
            (dew, "attention", "out"),
            lambda a: _transpose(a.reshape(heads * width, embed)),
            lambda w: np.ascontiguousarray(w.T).reshape(heads, width, embed),
            (heads, width, embed), (embed, heads * width))
        for name, kind in (("gate_proj", "wi_gate"), ("up_proj", "wi")):
            out[f"{hf}.mlp.{name}.weight"] = Tensor((dew, "mlp", kind), _transpose, _transpose,
                                                    (embed, mlp), (mlp, embed))
        out[f"{hf}.mlp.down_proj.weight"] = Tensor((dew, "mlp", "wo"), _transpose, _transpose,
                                                   (mlp, embed), (embed, mlp))
        out[f"{hf}.input_layernorm.weight"] = Tensor((dew, "attention_norm", "scale"), _same,
                                                     _same, (embed,), (embed,))
        out[f"{hf}.post_attention_layernorm.weight"] = Tensor((dew, "mlp_norm", "scale"), _same,
                                                              _same, (embed,), (embed,))
    return out



def _described(model: Any, field: str) -> Any:
    if field == "kv_heads":
        return model.num_kv_heads or model.num_heads
    return getattr(model, field)


def check_same_function(model: Any, loaded: Any, source: str) -> None:
    """Refuse to start model from loaded's weights unless both compute the same function.

    Shapes alone would let a different rope_theta or norm epsilon through,
    which gives the same tensors another meaning.
    """
    for field, key in MIRRORED.items():
        mine, theirs = _described(model, field), _described(loaded, field)
        if mine != theirs:
            setting = "model.num_kv_heads" if field == "kv_heads" else f"model.{field}"
            mirrored = f" ({key} in its config.json)" if key else ""
            raise ConfigurationMismatchError(
                f"{source} was trained with {field}={theirs!r}{mirrored}, but the model to start "
                f"from it has {mine!r}. Set {setting}={theirs!r} so the weights mean what they "
                "meant."
            )
