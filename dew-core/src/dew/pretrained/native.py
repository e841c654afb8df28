"""dew's own Pretrained layout, for models no published format describes exactly.

A diffusion transformer, a UNet or a token denoiser has no Hugging Face
counterpart whose tensors mean the same, so ``Pretrained.save`` writes it
in dew's own layout, which ``Pretrained.load`` reads back bit for bit:

- ``config.json``: ``{"format": "dew", "version": 1, "model": {"name": <its
  name in the dew.models registry>, "fields": {...}}, "task": null | {"name":
  <an objective's registered name>, "fields": {...}}, "dew": {"tokenizer":
  ...}}``. Fields are what a recipe gives (JSON values); a dtype is written
  by name ("bfloat16"). ``task`` is what the weights are for: the objective a
  pipeline is built from (``Pretrained.pipeline()``).
- ``model.safetensors``: every variable, named by its path through the
  variables tree with "/" between keys (``params/blocks_0/attention/query``),
  in the dtype it had.
- ``tokenizer.json`` when there is a tokenizer, as for the Llama layout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.pretrained.errors import PretrainedError, TensorMismatchError

if TYPE_CHECKING:
    from flax.linen import Module
    from numpy.typing import ArrayLike

    from dew.data.base import Tokenizer
    from dew.pretrained.model import Pretrained
    from dew.typing import PyTree

__all__ = ["FORMAT", "component_fields", "objective_pretrained", "objective_task", "registered_name", "read_variables",
           "shapes_of", "tensors_of", "unflatten"]

FORMAT = "dew"
VERSION = 1
_SKIPPED = {"parent", "name", "model", "tokenizer", "ema"}


def registered_name(group: str, component: object) -> str:
    """The name component's class is registered under in group (dew.models, dew.objectives)."""
    from dew import registry
    from dew.errors import DewError

    found = registry.registry(group)
    for name in found.names():
        try:
            if found.load(name) is type(component):
                return name
        except DewError:  # another distribution's entry point that does not load: not this component's
            continue
    raise PretrainedError(
        f"{type(component).__name__} is not registered in {group!r}, so a saved directory could "
        f"not build it again; register it (an entry point in the {group!r} group) to save it.")


def _json_value(owner: str, name: str, value: Any) -> Any:
    if isinstance(value, tuple):
        value = list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a RopeScaling: its fields, read back by them
        return {field.name: _json_value(owner, f"{name}.{field.name}", getattr(value, field.name))
                for field in dataclasses.fields(value)}
    try:
        json.dumps(value)
        return value
    except TypeError:
        pass
    try:
        return np.dtype(value).name  # jnp.float32, np.dtype('bfloat16') -> its name
    except TypeError:
        raise PretrainedError(
            f"{owner}.{name}={value!r} cannot be written to config.json; give it as a name or a "
            "number (a schedule as 'vp_cosine', say) to save it.") from None


def component_fields(component: Any) -> dict[str, Any]:
    """component's dataclass fields as JSON values, less the ones a saved directory rebuilds."""
    out = {}
    for field in dataclasses.fields(component):
        if field.name in _SKIPPED or field.name.startswith("_") or not field.init:
            continue
        out[field.name] = _json_value(type(component).__name__, field.name,
                                      getattr(component, field.name))
    return out


def objective_task(objective: Any) -> dict[str, Any]:
    """The task a saved directory records for objective: its registered name and its fields, from which
    ``Pretrained.pipeline()`` builds it again around the saved model."""
    if not dataclasses.is_dataclass(objective):
        raise PretrainedError(
            f"{type(objective).__name__} is not a dataclass, so its fields cannot be recorded as the task of "
            "a saved directory; make the objective a dataclass, or give Pretrained(task=...) yourself.")
    return {"name": registered_name("dew.objectives", objective), "fields": component_fields(objective)}


def objective_pretrained(objective: Any, variables: Mapping[str, PyTree]) -> Pretrained:
    """objective's model and tokenizer with variables, the objective kept as their task: what a
    pipeline built from an objective exports, for ``Pretrained.pipeline()`` to build it again."""
    import flax.linen as nn

    from dew.pretrained.model import Pretrained

    return Pretrained(objective.model, nn.meta.unbox(variables), objective.tokenizer, objective_task(objective))


def tensors_of(variables: Mapping[str, PyTree], prefix: str = "") -> dict[str, np.ndarray]:
    """Every leaf of a (host) variables tree by its '/'-joined path."""
    out: dict[str, np.ndarray] = {}
    for key, value in variables.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(tensors_of(value, path))
        else:
            out[path] = value if isinstance(value, np.ndarray) else np.asarray(value)
    return out


def shapes_of(variables: Mapping[str, PyTree], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Every leaf's shape by its '/'-joined path; the leaves may be abstract (jax.eval_shape's)."""
    out: dict[str, tuple[int, ...]] = {}
    for key, value in variables.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(shapes_of(value, path))
        else:
            out[path] = tuple(value.shape)
    return out


def unflatten(arrays: Mapping[str, ArrayLike]) -> dict[str, PyTree]:
    """The variables tree whose '/'-joined leaf paths are arrays' names."""
    tree: dict[str, PyTree] = {}
    for path, value in arrays.items():
        node = tree
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def config_of(model: Module, task: Mapping[str, Any] | None, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """config.json's content for model (the tokenizer entry is added by the writer)."""
    return {
        "format": FORMAT, "version": VERSION,
        "model": {"name": registered_name("dew.models", model), "fields": component_fields(model)},
        "task": None if task is None else dict(task),
    }


def build_model(config: Mapping[str, Any], source: Path) -> Module:
    """The model config.json describes, built through the dew.models registry."""
    from dew import models

    version = config.get("version")
    if version != VERSION:
        newer = type(version) is int and version > VERSION
        raise PretrainedError(f"{source} is dew layout version {version!r}; this dew reads version {VERSION}. "
                              + ("Upgrade dew (pip install -U dew-core, with the dew distributions installed "
                                 "beside it) to read it." if newer else "Export the run again with this dew (dew export RUN OUT), or read the "
                                 "folder with the dew that wrote it."))
    entry = config.get("model") or {}
    fields = dict(entry.get("fields", {}))
    for name, value in fields.items():  # a dtype is written by its name
        if name.endswith("dtype") and isinstance(value, str):
            import jax.numpy as jnp

            fields[name] = jnp.dtype(value)
    return models.build(entry["name"], **fields)


def read_variables(source: Path) -> dict[str, PyTree]:
    """Every tensor of source's model.safetensors, as the variables tree its names spell."""
    import jax.numpy as jnp

    from dew.pretrained.tensors import TensorFiles

    files = TensorFiles(source)
    names = files.names()
    unnamed = sorted(n for n in names if not n.split("/")[0])
    if unnamed:
        raise TensorMismatchError(f"{source} holds tensor(s) not named by a variable path: "
                                  f"{unnamed[:3]}; it was not written by Pretrained.save.")
    return unflatten({name: jnp.asarray(value) for name, value in files.read(names)})
