"""The checks a model directory passes before dew allocates anything for it.

A config.json is read only below a size cap and must be a JSON object; its
sizes must be positive integers, the layer count no more than the tensors
present, and the largest matrices no larger than the bytes present, so an
absurd value is refused naming its field instead of allocating gigabytes.
A tensor's stored dtype must convert to the parameter's without loss of
meaning: floats to floats (param_dtype is the user's cast), never an
integer or boolean into a float.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew.pretrained.errors import ConfigValueError, DamagedFileError, TensorMismatchError

__all__ = ["MAX_JSON_BYTES", "check_config_bounds", "check_config_sizes", "check_float_dtype", "read_json"]

MAX_JSON_BYTES = 16 * 2**20
"""The largest config.json (or adapter_config.json, index) dew reads (16 MB)."""

# config.json keys that are sizes (a positive integer when present).
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
         "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
         "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# config.json keys that count layers or experts: each needs at least one tensor of its own.
COUNTS = ("num_hidden_layers", "num_nextn_predict_layers", "num_local_experts", "num_experts", "n_routed_experts")
MAX_POSITIONS = 2**24  # a decode cache longer than this is a typo, not a model

FLOAT_KINDS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def read_json(path: Path, what: str = "config") -> dict[str, Any]:
    """path's JSON object; DamagedFileError, naming the file, when it is too large, not JSON, or
    not an object."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise DamagedFileError(f"{path} cannot be read ({error.strerror}); write the {what} again.") from None
    if size > MAX_JSON_BYTES:
        raise DamagedFileError(
            f"{path} is {size / 2**20:.0f} MB, more than the {MAX_JSON_BYTES // 2**20} MB a {what} "
            "file can be; it is not one (a weights file saved under its name?). Write it again.")
    try:
        read = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise DamagedFileError(f"{path} is not valid JSON ({error}); the {what} file is damaged or "
                               "cut short: write it again (Pretrained.save, `dew export`, or "
                               "save_pretrained).") from None
    if not isinstance(read, dict):
        raise DamagedFileError(f"{path} holds a JSON {type(read).__name__}, not the object a {what} "
                               "file holds; write it again.")
    return read


def check_config_sizes(config: Mapping[str, Any], path: Path) -> None:
    """Refuse a size field that is not a positive integer, before anything is built from it."""
    for key in SIZES:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigValueError(f"{path} sets {key}={value!r}; it must be a positive integer. "
                                   "Fix config.json (or write the model again).")


def check_config_bounds(config: Mapping[str, Any], path: Path, tensors: int, nbytes: int) -> None:
    """Refuse a size field that the weights present cannot hold (check_config_sizes first).

    tensors and nbytes count what the directory's safetensors headers hold.
    """
    for key in COUNTS:  # a family's description lists each layer's parts, its table each expert's
        count = config.get(key)
        if isinstance(count, int) and count > tensors:
            each = "layer" if key.endswith("layers") else "expert"
            raise ConfigValueError(
                f"{path} sets {key}={count}, but the weights hold {tensors} tensors, fewer than one per "
                f"{each}; config.json does not describe these weights. Fix {key}.")
    predicting = config.get("num_nextn_predict_layers")  # DeepSeek's layers past the last, left unread
    if predicting is not None and (isinstance(predicting, bool) or not isinstance(predicting, int)
                                   or predicting < 0):
        raise ConfigValueError(f"{path} sets num_nextn_predict_layers={predicting!r}; it must be a whole "
                               "number (0 for none). Fix config.json (or write the model again).")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions > MAX_POSITIONS:
        raise ConfigValueError(f"{path} sets max_position_embeddings={positions}, above the "
                               f"{MAX_POSITIONS} dew accepts; pass max_seq_len or fix config.json.")
    hidden = config.get("hidden_size")
    for key in ("vocab_size", "intermediate_size"):
        other = config.get(key)
        if isinstance(hidden, int) and isinstance(other, int) and hidden * other > nbytes:
            raise ConfigValueError(
                f"{path} sets hidden_size={hidden} and {key}={other}: one such matrix alone would "
                f"be {hidden * other} elements, more than the {nbytes} bytes of weights present. "
                "config.json does not describe these weights; fix it.")


def check_float_dtype(file: Path, name: str, stored: str) -> None:
    """Refuse a tensor stored as an integer or boolean where dew keeps a float parameter."""
    if stored not in FLOAT_KINDS:
        raise TensorMismatchError(
            f"{file} stores {name} as {stored}, but the parameter it fills is a float: an "
            f"{stored} tensor does not convert to one without changing its meaning. The file was "
            "written wrongly; write it again from a float model.")
