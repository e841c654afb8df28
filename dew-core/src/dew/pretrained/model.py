"""Pretrained: a model, its variables and its tokenizer, saved in the source's own format.

For dew's CausalTransformer built as a Llama (rotary positions, SwiGLU) the
format is Hugging Face's Llama: ``config.json`` and ``model.safetensors``
(plus ``tokenizer.json`` when the tokenizer has one), which
``transformers.AutoModelForCausalLM`` loads as it is, and which
``Pretrained.load`` reads back bit for bit. A directory that transformers
wrote for a Llama model loads the same way, to fine-tune or to sample from.
Every other model (a DiT, a UNet, a token denoiser, a CausalTransformer with
learned positions or gelu) is written in dew's own layout
(``dew.pretrained.native``), with the task its weights serve, so that
``Pretrained.load(directory).pipeline()`` samples as the pipeline that saved
it did.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dew.pretrained import llama, native
from dew.pretrained.errors import (
    NoExactCounterpartError,
    PretrainedError,
    TensorMismatchError,
    VocabularyMismatchError,
)
from dew.pretrained.tensors import WEIGHTS, TensorFiles, write_tensors
from dew.pretrained.tokenizers import read_tokenizer, write_tokenizer

__all__ = ["CONFIG_FILE", "Pretrained", "check_vocabulary"]

CONFIG_FILE = "config.json"
# What save's format names: the Hugging Face layout by its family, or dew's own.
_FORMATS = {"hf": "llama", "llama": "llama", native.FORMAT: native.FORMAT}


def check_vocabulary(tokenizer: Any, model: Any) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table."""
    have = getattr(model, "vocab_size", None)
    need = getattr(tokenizer, "vocab_size", None)
    if have is not None and need is not None and int(need) > int(have):
        raise VocabularyMismatchError(
            f"The tokenizer has {need} ids but the model's vocab_size is {have}: ids {have}..."
            f"{int(need) - 1} have no embedding row. Build the model with vocab_size >= {need} "
            "(model.vocab_size in a recipe) or use the tokenizer it was trained with."
        )


def _host(tree: Any) -> Any:
    """tree's arrays whole on the host, Flax's partitioning boxes removed.

    An array sharded across a process pool is gathered from every process
    (each must call this); one on local devices is simply copied.
    """
    import flax.linen as nn
    import jax
    from jax.experimental import multihost_utils

    def fetch(leaf: Any) -> np.ndarray:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(jax.device_get(leaf))

    return jax.tree.map(fetch, nn.meta.unbox(tree))


def _at(params: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = params
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class Pretrained:
    """A model with its variables and tokenizer, ready to save, share, sample or fine-tune.

    variables is the model's variable tree (``{"params": ...}``, as
    ``state.params`` holds it); tokenizer may be None. task names what the
    weights are for, as ``{"name": <a registered objective>, "fields":
    {...}}`` (a pipeline's save fills it in); only dew's own layout keeps it.

    >>> import tempfile, jax, jax.numpy as jnp
    >>> from dew.nn.backbones import CausalTransformer
    >>> model = CausalTransformer(vocab_size=32, emb_features=16, num_layers=1, num_heads=4,
    ...                           num_kv_heads=2, mlp_features=32, max_seq_len=16,
    ...                           position_embedding="rotary", mlp_activation="swiglu")
    >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    >>> with tempfile.TemporaryDirectory() as directory:
    ...     _ = Pretrained(model, variables).save(directory)
    ...     loaded = Pretrained.load(directory)
    >>> loaded.model == model
    True
    """

    model: Any
    variables: Mapping[str, Any]
    tokenizer: Any = None
    task: Mapping[str, Any] | None = None

    @property
    def format(self) -> str:
        """The model's own format: 'llama' (Hugging Face's layout) for a CausalTransformer that
        is exactly a Llama, else 'dew' (dew's own layout, which every registered model has)."""
        from dew.nn.backbones import CausalTransformer

        if not isinstance(self.model, CausalTransformer):
            return native.FORMAT
        if type(self.model) is CausalTransformer:
            try:
                llama.model_to_config(self.model)
            except NoExactCounterpartError:  # learned positions, gelu, experts: dew's own layout
                return native.FORMAT
        return "llama"  # a wrapped model is refused by save, saying how to export it

    def save(self, directory: str | os.PathLike[str], *, format: str | None = None) -> Path:
        """Write config.json, model.safetensors and the tokenizer into directory; return it.

        format None writes the model's own format (``format``); "hf" asks for
        the Hugging Face layout and raises NoExactCounterpartError, naming
        the field, when the model has no exact counterpart there; "dew"
        writes dew's own layout. In a process pool every process calls it
        (sharded weights are gathered) and process 0 writes.
        """
        import jax

        if self.tokenizer is not None:
            check_vocabulary(self.tokenizer, self.model)
        chosen = _FORMATS.get(format or self.format)
        if chosen is None:
            raise PretrainedError(f"Pretrained.save writes format 'hf' (Hugging Face) or 'dew' "
                                  f"(dew's own layout), not {format!r}.")
        if chosen == native.FORMAT:
            return self._save_native(Path(directory))
        eos = getattr(self.tokenizer, "eos_id", None)
        config = llama.model_to_config(self.model, eos_id=eos)
        params = _host(self.variables.get("params", self.variables))
        if getattr(self.model, "scan_layers", False):  # the format numbers its layers
            from dew.nn.pipeline import unstack_layers

            params = unstack_layers(params, self.model.num_layers)
        table = llama.tensors(self.model)
        out: dict[str, np.ndarray] = {}
        for name, tensor in table.items():
            value = _at(params, tensor.path)
            if value is None or tuple(value.shape) != tensor.dew_shape:
                found = None if value is None else tuple(value.shape)
                raise TensorMismatchError(
                    f"The variables have {found} at params/{'/'.join(tensor.path)}, but the "
                    f"model needs shape {tensor.dew_shape} there (for {name}, "
                    f"{tensor.hf_shape}). Save the variables this model was built with."
                )
            out[name] = tensor.to_hf(value)
        target = Path(directory)
        if jax.process_index() != 0:
            return target
        target.mkdir(parents=True, exist_ok=True)
        recorded = write_tokenizer(self.tokenizer, target)
        config["dew"] = {"dtype": np.dtype(self.model.dtype).name, "tokenizer": recorded}
        write_tensors(target / WEIGHTS, out, {"format": "pt"})
        (target / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return target

    def _save_native(self, target: Path) -> Path:
        """dew's own layout (see dew.pretrained.native): every variable by its path, the task."""
        import jax

        config = native.config_of(self.model, self.task, self.tokenizer)
        tensors = native.tensors_of(_host(self.variables))
        if jax.process_index() != 0:
            return target
        target.mkdir(parents=True, exist_ok=True)
        config["dew"] = {"tokenizer": write_tokenizer(self.tokenizer, target)}
        write_tensors(target / WEIGHTS, tensors, {"format": native.FORMAT})
        (target / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return target

    def pipeline(self, **fields: Any) -> Any:
        """The task's pipeline over these weights: its objective built again, then ``pipeline``.

        fields override the recorded objective fields (a tokenizer the
        directory could not keep, say). Raises PretrainedError when no task
        was saved, and TensorMismatchError, naming each path, when a
        saved variable does not fit the objective's model.
        """
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        from dew import registry

        if self.task is None:
            raise PretrainedError(
                f"These {type(self.model).__name__} weights record no task to build a pipeline for; "
                "save them through an objective's pipeline (objective.pipeline(state).save) or "
                "build the objective yourself and call its pipeline(variables).")
        given = dict(self.task.get("fields", {}))
        if self.tokenizer is not None:
            given.setdefault("tokenizer", self.tokenizer)
        objective = registry.objectives.build(self.task["name"], model=self.model,
                                              **{**given, **fields})
        fresh = native.tensors_of(jax.eval_shape(lambda k: nn.meta.unbox(objective.init(k)),
                                                 jax.random.key(0)))
        variables = jax.tree.map(jnp.asarray, dict(self.variables))
        # A pipeline may keep part of the objective's variables (an encoder without its
        # predictor); each kept one must sit where, and be shaped as, the objective makes it.
        wrong = [f"{path}: shape {tuple(value.shape)}, expected "
                 f"{tuple(fresh[path].shape) if path in fresh else 'no such variable'}"
                 for path, value in native.tensors_of(variables).items()
                 if path not in fresh or tuple(fresh[path].shape) != tuple(value.shape)]
        if wrong:
            raise TensorMismatchError(
                f"The saved variables do not fit the {self.task['name']} objective's model: "
                f"{'; '.join(wrong[:6])}{f'; and {len(wrong) - 6} more' if len(wrong) > 6 else ''}. "
                "Load them with the model configuration they were saved with.")
        return objective.pipeline(variables)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, max_seq_len: int | None = None,
             param_dtype: Any = None, dtype: Any = None, scan_layers: bool = False) -> Pretrained:
        """Read a directory Pretrained.save or transformers' save_pretrained wrote.

        A directory in dew's own layout comes back as it was saved, task
        included; the options below apply to the Llama layout. max_seq_len
        overrides the config's max_position_embeddings (the decode cache is
        that long); param_dtype casts the weights (default: as stored);
        scan_layers builds the model with its layers as one scanned stack
        (the one pipeline stages split) and stacks the numbered layers the
        file holds into it. Raises UnsupportedArchitectureError,
        NoExactCounterpartError or TensorMismatchError, each naming what is
        wrong.
        """
        import jax.numpy as jnp

        source = Path(directory)
        config_path = source / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{source} holds no {CONFIG_FILE}; point at a directory that Pretrained.save, "
                "`dew export` or transformers' save_pretrained wrote."
            )
        config = json.loads(config_path.read_text())
        own = config.get("dew") or {}
        if config.get("format") == native.FORMAT:
            model = native.build_model(config, source)
            variables = native.read_variables(source)
            tokenizer = read_tokenizer(source, own.get("tokenizer"), None)
            return cls(model, variables, tokenizer, config.get("task"))
        dtype = dtype or own.get("dtype")
        model = llama.config_to_model(config, max_seq_len=max_seq_len,
                                      param_dtype=param_dtype, dtype=dtype)
        files = TensorFiles(source)
        table = llama.tensors(model)
        found = files.shapes()
        missing = sorted(set(table) - set(found))
        if missing:
            name = missing[0]
            raise TensorMismatchError(
                f"{source} lacks {len(missing)} tensor(s) the model needs, first {name} "
                f"(shape {table[name].hf_shape}, params/{'/'.join(table[name].path)} in dew)."
            )
        ignorable = {n for n in found if n.endswith("rotary_emb.inv_freq")}
        if model.tie_embeddings:
            ignorable.add("lm_head.weight")  # some writers keep the tied copy
        extra = sorted(set(found) - set(table) - ignorable)
        if extra:
            raise TensorMismatchError(
                f"{source} holds tensor(s) this Llama has no place for: {', '.join(extra[:5])}. "
                "Was the checkpoint saved from another architecture?"
            )
        for name, tensor in table.items():
            if found[name] != tensor.hf_shape:
                raise TensorMismatchError(
                    f"Tensor {name} in {source} has shape {found[name]}, but config.json makes "
                    f"it {tensor.hf_shape} (params/{'/'.join(tensor.path)} of shape "
                    f"{tensor.dew_shape} in dew)."
                )
        params: dict[str, Any] = {}
        for name, value in files.read(set(table)):
            tensor = table[name]
            node = params
            for part in tensor.path[:-1]:
                node = node.setdefault(part, {})
            node[tensor.path[-1]] = jnp.asarray(tensor.from_hf(value), model.param_dtype)
        if scan_layers:  # the format numbers its layers; the scanned model holds them stacked
            from dew.nn.pipeline import stack_layers

            model = model.clone(scan_layers=True)
            params = stack_layers(params, model.num_layers)
        tokenizer = read_tokenizer(source, own.get("tokenizer"), config.get("eos_token_id"))
        if tokenizer is not None:
            check_vocabulary(tokenizer, model)
        return cls(model, {"params": params}, tokenizer)
