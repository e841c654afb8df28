"""Pretrained: a model, its variables and its tokenizer, saved in the source's own format.

For dew's CausalTransformer the format is its family's Hugging Face layout
(``dew.families``: Llama, Mistral, Qwen 2 and 3, Gemma 1 to 3, Phi-3,
OLMo 2, Mixtral, Qwen3-MoE, DeepSeek-V3) when the family expresses the model
exactly: ``config.json`` and ``model.safetensors`` (sharded with an index
when large), plus the tokenizer, which ``transformers.AutoModelForCausalLM``
loads as that family and ``Pretrained.load`` reads back bit for bit. A
directory transformers wrote for any of those families loads the same way,
to fine-tune or to sample from. Every other model (a DiT, a UNet, a token
denoiser, a CausalTransformer with learned positions or gelu) is written in
dew's own layout (``dew.pretrained.native``), with the task its weights
serve, so that ``Pretrained.load(directory).pipeline()`` samples as the
pipeline that saved it did.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.data.base import NamesSpecialTokens, eos_id_of, listed_ids, stop_ids_of, vocab_size_of
from dew.families import scoring
from dew.families.hf_config import training_settings
from dew.pretrained import native
from dew.pretrained.errors import (
    ConfigValueError,
    NoExactCounterpartError,
    NoPretrainedModelError,
    PretrainedError,
    TensorMismatchError,
    VocabularyMismatchError,
)
from dew.pretrained.reading import (
    check_config_bounds,
    check_config_sizes,
    check_float_dtype,
    read_json,
)
from dew.pretrained.tensors import WEIGHTS, ShardWriter, TensorFiles, write_tensors
from dew.pretrained.tokenizers import TokenizerFiles, read_tokenizer, write_tokenizer
from dew.pretrained.writing import replacing
from dew.tree_summary import brief_repr

if TYPE_CHECKING:
    from flax.linen import Module
    from jax import Array
    from jax.sharding import Sharding
    from jax.typing import DTypeLike
    from numpy.typing import ArrayLike

    from dew.objectives.inference import Pipeline
    from dew.typing import PyTree

__all__ = ["CONFIG_FILE", "MAX_SHARD_BYTES", "Pretrained", "check_vocabulary", "model_from_config"]

CONFIG_FILE = "config.json"
MAX_SHARD_BYTES = 5 * 2**30
"""The largest safetensors file Pretrained.save writes before it shards (5 GiB)."""


def model_from_config(config: Mapping[str, Any], *, max_seq_len: int | None = None,
                      param_dtype: DTypeLike | None = None, dtype: DTypeLike | None = None) -> Module:
    """The CausalTransformer a Hugging Face config.json describes, through its family.

    Raises UnsupportedArchitectureError (naming the architecture and the
    covered ones) or NoExactCounterpartError (naming the config field).
    """
    from dew.families import for_config

    dtype = dtype or (config.get("dew") or {}).get("dtype")
    return for_config(config).model(config, max_seq_len=max_seq_len, param_dtype=param_dtype,
                                    dtype=dtype)


def check_vocabulary(tokenizer: object, model: Module, *, starts_from: str | None = None) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table. starts_from names the
    trained weights a run starts from (a recipe's init), whose embedding no vocab_size can grow."""
    # Any flax Module: one that does not say its vocabulary is not checked; nor a tokenizer that does not.
    have = getattr(model, "vocab_size", None)
    need = vocab_size_of(tokenizer)
    if have is None or need is None or int(need) <= int(have):
        return
    if starts_from is not None:  # raising model.vocab_size would only meet the init's refusal of it
        raise VocabularyMismatchError(
            f"The tokenizer has {need} ids but the model's vocab_size is {have}, and the weights the run starts "
            f"from ({starts_from}, the recipe's init) keep that many embedding rows: dew does not grow a trained "
            "embedding. Use the tokenizer those weights were trained with (data.tokenizer), or one whose added "
            "tokens fit in the rows they hold (a published checkpoint's vocab_size often leaves some past its "
            "tokenizer).")
    raise VocabularyMismatchError(
        f"The tokenizer has {need} ids but the model's vocab_size is {have}: ids {have}..."
        f"{int(need) - 1} have no embedding row. Build the model with vocab_size >= {need} "
        "(model.vocab_size in a recipe) or use the tokenizer it was trained with."
    )


def _fetch(leaf: ArrayLike) -> np.ndarray:
    """One array whole on the host: gathered from every process of a pool (each must call
    this, in the same order), or copied from local devices."""
    import jax
    from jax.experimental import multihost_utils

    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def _host(tree: PyTree) -> PyTree:
    """tree's arrays whole on the host, Flax's partitioning boxes removed."""
    import flax.linen as nn
    import jax

    return jax.tree.map(_fetch, nn.meta.unbox(tree))


def _placement(shardings: PyTree) -> Callable[[tuple[str, ...]], PyTree]:
    """Where each loaded parameter goes: its sharding in shardings (a tree like the variables'
    or their params'), or the default device when shardings is None or has no such path."""
    if shardings is None:
        return lambda path: None
    import flax.linen as nn

    tree = nn.meta.unbox(shardings)
    tree = tree.get("params", tree) if isinstance(tree, Mapping) else tree
    return lambda path: _at(tree, path)


def _put(array: np.ndarray, dtype: DTypeLike, sharding: Sharding | None) -> Array:
    """array, a view of file pages about to be released, copied onto the devices in dtype: its
    sharding's, else the default device's, in one pass over its bytes when no cast is asked. A
    transposed view is left to device_put, whose transposing copy is far faster than numpy's; a
    contiguous one is cast into fresh memory aligned as a CPU device takes it as its own, so
    device_put copies it no second time. No compiled program runs, so loading compiles nothing."""
    import jax

    view = np.asarray(array)
    if view.flags.c_contiguous:  # cast (if at all) and copied out of the file's pages at once
        return jax.device_put(_aligned_copy(view, np.dtype(dtype)), sharding).block_until_ready()
    return jax.device_put(view.astype(np.dtype(dtype), copy=False), sharding).block_until_ready()


_ALIGNMENT = 64  # the bytes a CPU device's buffers are aligned to; an aligned host array is taken as is


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array of shape and dtype in fresh pages on an _ALIGNMENT boundary."""
    from dew.pretrained.tensors import fresh_pages

    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return fresh_pages(nbytes, _ALIGNMENT).view(dtype).reshape(shape)


def _aligned_copy(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """array cast to dtype in fresh memory starting on an _ALIGNMENT boundary."""
    copy = _aligned_empty(array.shape, dtype)
    np.copyto(copy, array, casting="unsafe")
    return copy


_Filling = dict[tuple[str, ...], tuple[np.ndarray, int]]  # a stacked weight's buffer and its slots filled


def _fill(filling: _Filling, path: tuple[str, ...], index: int, count: int, array: np.ndarray,
          dtype: np.dtype) -> np.ndarray | None:
    """array copied (cast to dtype) into slot index of path's stack of count slots; the stack once
    its last slot is filled, else None. Slices of a weight stored one by one (an expert's, a
    layer's) meet there without the loaded pieces and the stack ever being held together."""
    import jax

    stack, filled = filling.get(path) or (_aligned_empty((count, *array.shape), dtype), 0)
    if not array.flags.c_contiguous:  # device_put's transposing copy is far faster than numpy's
        array = np.asarray(jax.device_put(array))
    np.copyto(stack[index], array, casting="unsafe")
    if filled + 1 < count:
        filling[path] = (stack, filled + 1)
        return None
    filling.pop(path, None)
    return stack


def _layer_of(path: tuple[str, ...]) -> tuple[int, tuple[str, ...]] | None:
    """(i, the path in the scanned stack) for a path under the numbered layer layers_i, else None.

    >>> _layer_of(("layers_3", "mlp", "wi")), _layer_of(("embed", "embedding"))
    ((3, ('layers', 'mlp', 'wi')), None)
    """
    head, _, index = path[0].rpartition("_")
    if head != "layers" or not index.isdigit():
        return None
    return int(index), ("layers", *path[1:])


def _at(params: Mapping[str, PyTree], path: tuple[str, ...]) -> PyTree:
    node: PyTree = params
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
    tokenizer_files keeps what a Hugging Face directory says about its
    tokenizer beyond ``tokenizer.json`` (special tokens, the chat template,
    generation's stop ids), written back unchanged by save. context is the
    context length (``max_position_embeddings``) of the Hugging Face
    directory the weights were read from: save never writes a shorter one, so
    weights trained or loaded with a short ``max_seq_len`` (the decode cache's
    length) keep the context they were published with. training keeps the
    directory's config.json keys that say how transformers trains the weights
    rather than what they compute (``router_aux_loss_coef``,
    ``output_router_logits``, ...): save writes them over the family's defaults.

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

    model: Module
    variables: Mapping[str, PyTree]
    tokenizer: Any = None
    task: Mapping[str, Any] | None = None
    tokenizer_files: TokenizerFiles | None = None
    context: int | None = None
    training: Mapping[str, Any] | None = None

    __repr__ = brief_repr  # the variables as one line, not every array

    @property
    def format(self) -> str:
        """The model's own format: the Hugging Face layout of the family a CausalTransformer
        names ('qwen3', ...), or Llama's when it names none and is exactly a Llama (a reward
        model's as the family's sequence-classification model, dew.families.scoring); else 'dew'
        (dew's own layout, which every registered model has)."""
        from dew.families import of_model
        from dew.nn.backbones import CausalTransformer

        if not isinstance(self.model, CausalTransformer):
            return native.FORMAT
        if self.model.family is not None:  # a family it claims: save refuses what it cannot express
            return native.FORMAT if self.beyond_family() else self.model.family
        try:
            of_model(self.model).config(self.model)
        except NoExactCounterpartError:  # learned positions, gelu, ...: dew's own layout
            return native.FORMAT
        return native.FORMAT if self.beyond_family() else "llama"

    def beyond_family(self) -> list[str]:
        """The top-level parameters the family's Hugging Face layout has no place for (a reward
        model's scalar head beside its decoder, say): saving in that layout would drop them."""
        from dew.families import of_model

        covered = {path[0] for entry in of_model(self.model).table(self.model).values() for path in entry.paths}
        if scoring.scored(self.model, self.variables, self.task):  # a reward model's score
            covered.add(scoring.HEAD)
        if getattr(self.model, "scan_layers", False):  # the stacked layers the table numbers
            covered.add("layers")
        return sorted(set(self.variables.get("params", self.variables)) - covered)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template, as the directory it was read from wrote it (None: none)."""
        return None if self.tokenizer_files is None else self.tokenizer_files.chat_template

    def save(self, directory: str | os.PathLike[str], *, format: str | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES, force: bool = False) -> Path:
        """Write config.json, the safetensors weights and the tokenizer into directory; return it.

        format None writes the model's own format (``format``); "hf" asks for
        its family's Hugging Face layout and raises NoExactCounterpartError,
        naming the field, when the model has no exact counterpart there, before
        anything is written; "dew" writes dew's own layout. The Hugging Face
        layout is written in files of at most max_shard_bytes (more than one:
        with an index, as transformers shards). In a process pool every
        process calls it (sharded weights are gathered one tensor at a time)
        and process 0 writes.

        The directory is written whole or not at all (``dew.pretrained.writing``):
        into a fresh directory beside it, then swapped in. One that holds files
        dew did not write is refused (ExportDirectoryError) unless force, which
        keeps those files and replaces only the export's own.
        """
        import jax

        from dew.families import of_model

        if self.tokenizer is not None:
            check_vocabulary(self.tokenizer, self.model)
        chosen = format or self.format
        if chosen not in ("hf", native.FORMAT, self.format):
            raise PretrainedError(f"Pretrained.save writes format 'hf' (Hugging Face) or 'dew' "
                                  f"(dew's own layout), not {format!r}.")
        if chosen == native.FORMAT:
            return self._save_native(Path(directory), force)
        family = of_model(self.model)
        config = family.config(self.model)
        config.update(self._token_ids())
        config.update(self.training or {})
        if self.context is not None and self.context > int(config.get("max_position_embeddings") or 0):
            config["max_position_embeddings"] = int(self.context)
        extra = self.beyond_family()
        if extra:
            fields = (self.task or {}).get("fields") or {}
            why = (f" (a reward model's score is the layout's only over the final norm's output, and this one "
                   f"reads {fields['features_module']!r}: its features_module)"
                   if scoring.HEAD in extra and fields.get("features_module", scoring.FEATURES) != scoring.FEATURES
                   else "")
            raise NoExactCounterpartError(
                f"The variables hold params/{', params/'.join(extra)} beside the model's own, which "
                f"the Hugging Face layout has no place for{why}; save with format 'dew' (dew's own "
                "layout keeps every variable).")
        params = _host(self.variables.get("params", self.variables))
        if getattr(self.model, "scan_layers", False):  # the format numbers its layers
            from dew.nn.pipeline import unstack_layers

            params = unstack_layers(params, self.model.num_layers)
        own: dict[str, Any] = {}  # what config.json's "dew" keeps beside the dtype and tokenizer
        if scoring.scored(self.model, self.variables, self.task):
            table, config = scoring.table(family, self.model), scoring.written(family, config)
            own["task"] = dict(self.task or {})
            if config.get("pad_token_id") is None:  # transformers scores a batch at its last non-pad token
                pad = _special_id(self.tokenizer, self.tokenizer_files, "pad_token")
                if pad is not None:
                    config["pad_token_id"] = pad
        else:
            table = family.table(self.model)
        for name, entry in table.items():  # every tensor checked before a byte is written
            for path, shape in zip(entry.paths, entry.dew_shapes, strict=True):
                value = _at(params, path)
                stored = None if value is None else tuple(value.shape)
                if entry.index is not None and stored is not None:  # one expert of a stacked weight
                    stored = stored[1:] if stored and entry.index < stored[0] else None
                if stored != shape:
                    found = None if value is None else tuple(value.shape)
                    raise TensorMismatchError(
                        f"The variables have {found} at params/{'/'.join(path)}, but the model needs "
                        f"shape {shape} there (for {name}, {entry.hf_shape}). Save the variables "
                        "this model was built with.")
        target = Path(directory)
        writing = jax.process_index() == 0
        with replacing(target, force=force) if writing else contextlib.nullcontext(target) as fresh:
            self._write_hf(fresh, writing, table, params, config, max_shard_bytes, own)
        return target

    def _write_hf(self, target: Path, writing: bool, table: Mapping[str, Any], params: Any,
                  config: dict[str, Any], max_shard_bytes: int, own: Mapping[str, Any]) -> None:
        shards = ShardWriter(target, max_shard_bytes, {"format": "pt"})
        stacked: dict[tuple[str, ...], np.ndarray] = {}  # the stacked weights being written expert by expert
        for name, entry in table.items():
            if entry.index is None:
                arrays = [_fetch(_at(params, path)) for path in entry.paths]
            else:
                if set(entry.paths) != set(stacked):
                    stacked = {path: _fetch(_at(params, path)) for path in entry.paths}
                arrays = [stacked[path][entry.index] for path in entry.paths]
            value = entry.layout.to_hf(arrays)
            if writing:
                shards.add(name, value)
        if not writing:
            return
        shards.close()
        recorded = write_tokenizer(self.tokenizer, target)
        if self.tokenizer_files is not None:
            self.tokenizer_files.write(target)
            _stop_in_generation_config(target, stop_ids_of(self.tokenizer))
        config["dew"] = {"dtype": np.dtype(self.model.dtype).name, "tokenizer": recorded, **own}
        (target / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    def _token_ids(self) -> dict[str, Any]:
        """config.json's special-token ids: those the source directory had, else the tokenizer's eos
        and the bos and pad tokens its files name."""
        ids: dict[str, Any] = {}
        eos = eos_id_of(self.tokenizer)
        if eos is not None:
            ids["eos_token_id"] = int(eos)
        if self.tokenizer_files is not None and self.tokenizer_files.ids:
            ids.update(self.tokenizer_files.ids)  # as the source config.json had them
        else:
            # no source config.json (a run from scratch with a family's tokenizer): the bos and pad
            # tokens the tokenizer names, else transformers takes its class's defaults (Gemma's bos 2,
            # pad 0), ordinary tokens of this vocabulary
            for key, name in (("bos_token_id", "bos_token"), ("pad_token_id", "pad_token")):
                found = _special_id(self.tokenizer, self.tokenizer_files, name)
                if found is not None:
                    ids[key] = found
        # Every id a continuation ends at (a policy's stop token besides the eos), as a list
        # transformers' generate stops at too.
        stops = [*listed_ids(ids.get("eos_token_id")), *stop_ids_of(self.tokenizer)]
        if len(set(stops)) > 1:
            ids["eos_token_id"] = list(dict.fromkeys(stops))
        return ids

    def _save_native(self, target: Path, force: bool = False) -> Path:
        """dew's own layout (see dew.pretrained.native): every variable by its path, the task."""
        import jax

        config = native.config_of(self.model, self.task, self.tokenizer)
        tensors = native.tensors_of(_host(self.variables))
        if jax.process_index() != 0:
            return target
        with replacing(target, force=force) as fresh:
            config["dew"] = {"tokenizer": write_tokenizer(self.tokenizer, fresh)}
            # What a Hugging Face directory said beside its tokenizer (the chat template, the
            # special ids, the published context) travels through dew's layout as through theirs.
            if self.tokenizer_files is not None:
                self.tokenizer_files.write(fresh)
                config.update(self.tokenizer_files.ids)
            if self.context is not None:
                config["dew"]["context"] = int(self.context)
            if self.training:
                config["dew"]["training"] = dict(self.training)
            write_tensors(fresh / WEIGHTS, tensors, {"format": native.FORMAT})
            (fresh / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return target

    def pipeline(self, **fields: Any) -> Pipeline:
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
        from dew.nn.backbones import CausalTransformer

        task = self.task
        if task is None and isinstance(self.model, CausalTransformer):  # a language model: it continues text
            task = {"name": "lm", "fields": {"seq_len": self.model.max_seq_len}}
        if task is None:
            raise PretrainedError(
                f"These {type(self.model).__name__} weights record no task to build a pipeline for: the "
                "Pretrained they were saved from named none. Save them with their objective as the task "
                "(dew.pretrained.native.objective_pretrained(objective, variables), what a pipeline's "
                "pretrained() returns; dew export records the run's objective), or build the objective "
                "yourself and call its pipeline(variables).")
        given = dict(task.get("fields", {}))
        if self.tokenizer is not None:
            given.setdefault("tokenizer", self.tokenizer)
        objective = registry.objectives.build(task["name"], model=self.model,
                                              **{**given, **fields})
        fresh = native.shapes_of(jax.eval_shape(lambda k: nn.meta.unbox(objective.init(k)),
                                                jax.random.key(0)))
        variables = jax.tree.map(jnp.asarray, dict(self.variables))
        # A pipeline may keep part of the objective's variables (an encoder without its
        # predictor); each kept one must sit where, and be shaped as, the objective makes it.
        wrong = [f"{path}: shape {shape}, expected {fresh.get(path, 'no such variable')}"
                 for path, shape in native.shapes_of(variables).items() if fresh.get(path) != shape]
        if wrong:
            raise TensorMismatchError(
                f"The saved variables do not fit the {task['name']} objective's model: "
                f"{'; '.join(wrong[:6])}{f'; and {len(wrong) - 6} more' if len(wrong) > 6 else ''}. "
                "Load them with the model configuration they were saved with.")
        return objective.pipeline(variables)

    @classmethod
    def describe(cls, directory: str | os.PathLike[str], *, max_seq_len: int | None = None,
                 param_dtype: DTypeLike | None = None, scan_layers: bool = False) -> Pretrained:
        """What load would give, with no weight read: the model, task and tokenizer of directory,
        after every check load makes of its config.json and its tensors' headers (names, shapes,
        dtypes). Its variables are empty: ``dew train --check`` refuses the starting weights a run
        would refuse without reading gigabytes of them."""
        return cls._read(Path(directory), max_seq_len=max_seq_len, param_dtype=param_dtype, dtype=None,
                         scan_layers=scan_layers, shardings=None, weights=False)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, max_seq_len: int | None = None,
             param_dtype: DTypeLike | None = None, dtype: DTypeLike | None = None, scan_layers: bool = False,
             shardings: PyTree = None) -> Pretrained:
        """Read a directory Pretrained.save or transformers' save_pretrained wrote.

        A directory in dew's own layout comes back as it was saved, task
        included; the options below apply to the Hugging Face layouts, whose
        family config.json names (``dew.families``). max_seq_len overrides the
        config's max_position_embeddings (the decode cache is that long);
        param_dtype casts the weights (default: as stored); scan_layers
        builds the model with its layers as one scanned stack (the one
        pipeline stages split) and stacks the numbered layers the file holds
        into it; shardings (a tree of shardings like the variables', as
        ``Layout.shardings`` gives) places each tensor straight into its
        sharding as it is read, one tensor at a time. A family's one-label
        ``...ForSequenceClassification`` comes back as a reward model (its
        task ``reward_model``, the score beside the decoder: dew.families.scoring). Raises
        UnsupportedArchitectureError, NoExactCounterpartError or
        TensorMismatchError, each naming what is wrong, before any weight is
        read.
        """
        return cls._read(Path(directory), max_seq_len=max_seq_len, param_dtype=param_dtype, dtype=dtype,
                         scan_layers=scan_layers, shardings=shardings, weights=True)

    @classmethod
    def _read(cls, source: Path, *, max_seq_len: int | None, param_dtype: DTypeLike | None,
              dtype: DTypeLike | None, scan_layers: bool, shardings: PyTree, weights: bool) -> Pretrained:
        from dew.families import for_config

        config_path = source / CONFIG_FILE
        if not config_path.is_file():
            what = " (the directory does not exist)" if not source.exists() else ""
            raise NoPretrainedModelError(
                f"{source} holds no {CONFIG_FILE}{what}, so there is no model to load; point at a directory that "
                f"Pretrained.save, `dew export` or transformers' save_pretrained wrote ({CONFIG_FILE} "
                "beside the weights), or write one there first."
            )
        config = read_json(config_path)
        own = config.get("dew") or {}
        if not isinstance(own, Mapping):
            raise ConfigValueError(f"{config_path} sets dew={own!r}; dew writes an object there. "
                                   "Remove the key or write the model again.")
        if config.get("format") == native.FORMAT:
            model = native.build_model(config, source)
            variables = native.read_variables(source) if weights else {}
            kept = TokenizerFiles.read(source, config)
            tokenizer = read_tokenizer(source, own.get("tokenizer"), None, kept)
            context, training = own.get("context"), own.get("training")
            return cls(model, variables, tokenizer, config.get("task"), kept,
                       int(context) if isinstance(context, int) else None,
                       dict(training) if isinstance(training, Mapping) else None)
        family = for_config(config)
        scorer = scoring.is_scorer(config, config_path)  # a reward model's decoder and score
        _refuse_quantized(config, config_path)
        check_config_sizes(config, config_path)  # a size that is no positive integer, named as such
        # The bounds come before the model's description: a family's description lists its
        # layers' parts (sliding windows, dense layers), so num_hidden_layers=10**9 would allocate
        # and hang there. With no weights at all, a value without a counterpart is named first.
        try:
            files: TensorFiles | None = TensorFiles(source)  # every header checked
        except NoPretrainedModelError:
            files = None
        if files is not None:
            check_config_bounds(config, config_path, len(files.names()), files.nbytes)
        if param_dtype is None and files is not None and not (config.get("dtype") or config.get("torch_dtype")):
            param_dtype = _stored_float(files)  # as transformers' dtype="auto" reads a config that names none
        try:  # the model's description only (no array)
            model = family.model(config, max_seq_len=max_seq_len, param_dtype=param_dtype,
                                 dtype=dtype or own.get("dtype"))
        except (TypeError, ValueError, KeyError) as error:
            if isinstance(error, PretrainedError):
                raise
            raise ConfigValueError(f"{config_path} does not describe a {family.architecture} dew can "
                                   f"build: {type(error).__name__}: {error}. Fix config.json or write "
                                   "the model again.") from None
        if files is None:
            files = TensorFiles(source)  # no weights: NoPretrainedModelError, naming the directory
        if scorer:  # no language-model head is stored: the embedding stands in (its logits go unread)
            model = model.clone(tie_embeddings=True)
            table = scoring.table(family, model)
        else:
            model = _untied_if_stored_apart(model, files, config_path)
            table = family.table(model)
        unread = family.unread(config)  # tensors the model does not compute, left in the files
        _check_tensors(source, scoring.architecture(family.architecture) if scorer else family.architecture, model, table,
                       {name: shape for name, shape in files.shapes().items() if not name.startswith(unread)})
        stored = files.dtypes()
        for name in table:
            check_float_dtype(files.files[name], name, stored[name])
        params = _read_params(files, table, model, scan_layers, shardings) if weights else {}
        if scan_layers:  # the format numbers its layers; the scanned model holds them stacked
            model = model.clone(scan_layers=True)
        kept = TokenizerFiles.read(source, config)
        tokenizer = read_tokenizer(source, own.get("tokenizer"), config.get("eos_token_id"), kept)
        if tokenizer is not None:
            check_vocabulary(tokenizer, model)
        task = scoring.task(config, model) if scorer else None
        return cls(model, {"params": params} if weights else {}, tokenizer, task, kept, family.context(config),
                   training_settings(config) or None)


def _read_params(files: TensorFiles, table: Mapping[str, Any], model: Module, scan_layers: bool,
                 shardings: PyTree) -> dict[str, PyTree]:
    """The model's parameters read from files one tensor at a time, each converted by its entry of
    the family's table and placed (in its sharding, when shardings gives one)."""
    import jax

    place = _placement(shardings)  # under scan_layers, the scanned model's tree of shardings
    params: dict[str, PyTree] = {}
    experts: dict[tuple[str, ...], int] = {}  # a stacked weight's slices, stored one by one
    for entry in table.values():
        if entry.index is not None:
            for path in entry.paths:
                experts[path] = max(experts.get(path, 0), entry.index + 1)
    pending: _Filling = {}  # the stacked experts' weights being filled
    stacks: _Filling = {}  # scan_layers: the stacked layers' weights being filled
    for name, value in files.mapped(set(table)):  # value's pages are gone at the next tensor
        entry = table[name]
        arrays = entry.layout.from_hf(value)
        as_stored = (entry.index is None and len(arrays) == 1 and arrays[0].flags.c_contiguous
               and arrays[0].dtype == np.dtype(model.param_dtype))
        if as_stored:  # kept as stored: read once into memory the device takes as its own
            arrays = entry.layout.from_hf(files.read_aligned(name))
        for path, array in zip(entry.paths, arrays, strict=True):
            if entry.index is not None:  # one expert: held on the host until its last slice arrives
                whole = _fill(pending, path, entry.index, experts[path], array, array.dtype)
                if whole is None:
                    continue
                array = whole
            layer = _layer_of(path) if scan_layers else None
            if layer is not None:  # one layer: its slot of the stack the scanned model holds
                index, path = layer
                whole = _fill(stacks, path, index, model.num_layers, array, np.dtype(model.param_dtype))
                if whole is None:
                    continue
                array, as_stored = whole, True  # aligned and cast: taken onto the device as it is
            node = params
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = (jax.device_put(array, place(path)).block_until_ready() if as_stored
                              else _put(array, model.param_dtype, place(path)))
    return params


def _stop_in_generation_config(target: Path, stops: Sequence[int]) -> None:
    """Add the ids a policy stops at (its recipe's stop_token) to the generation_config.json the
    checkpoint's files brought: transformers' generate reads its eos_token_id there, not config.json's,
    and went on past the stop where dew's generation ends."""
    path = target / "generation_config.json"
    if not stops or not path.is_file():
        return
    settings = json.loads(path.read_text())
    listed = listed_ids(settings.get("eos_token_id"))
    merged = list(dict.fromkeys([*listed, *(int(stop) for stop in stops)]))
    if merged != listed:
        settings["eos_token_id"] = merged
        path.write_text(json.dumps(settings, indent=2) + "\n")


def _special_id(tokenizer: Any, files: TokenizerFiles | None, name: str) -> int | None:
    """The id of the special token (bos_token, pad_token) the tokenizer's files name, or the
    tokenizer itself without them (None: they name none, or it is no one id)."""
    named = files.special_tokens if files is not None else (
        tokenizer.special_tokens if isinstance(tokenizer, NamesSpecialTokens) else {})
    token = named.get(name)
    if token is None or tokenizer is None:
        return None
    ids = [int(i) for i in tokenizer.encode(token)]
    return ids[0] if len(ids) == 1 else None


def _refuse_quantized(config: Mapping[str, Any], path: Path) -> None:
    """A directory whose weights are stored quantized (DeepSeek-V3's fp8 blocks with their scales,
    GPTQ, AWQ, bitsandbytes) is refused by its quantization_config: its tensors are codes, not the
    weights, and no dew layer reads them as they are."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method", "?") if isinstance(quantization, Mapping) else quantization
    raise NoExactCounterpartError(
        f"{path} sets quantization_config.quant_method={method!r}: its weights are stored quantized, "
        "and dew reads float weights (fp32, bf16 or fp16). Load a dequantized copy instead (for "
        "DeepSeek-V3/R1's fp8 checkpoints, their bf16 conversion), or quantize after loading with a "
        "recipe's lora.base (QLoRA).")


_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _stored_float(files: TensorFiles) -> str | None:
    """The float type most of the stored tensors are in (None: none is a float dew reads)."""
    import collections

    kinds = collections.Counter(_FLOATS[kind] for kind in files.dtypes().values() if kind in _FLOATS)
    return kinds.most_common(1)[0][0] if kinds else None


def _untied_if_stored_apart(model: Module, files: TensorFiles, config_path: Path) -> Module:
    """model with its own output head when config.json ties it to the embedding but the weights hold
    an lm_head.weight of other values: transformers then leaves the two untied and reads both (with
    a warning), so the logits are the head's; a copy equal to the embedding is the tied weight."""
    names = files.names()
    if not getattr(model, "tie_embeddings", False) or _HEAD not in names or _EMBEDDING not in names:
        return model
    if np.array_equal(files.read_aligned(_HEAD), files.read_aligned(_EMBEDDING)):
        return model
    import warnings

    warnings.warn(f"{config_path} ties the output head to the embedding (tie_word_embeddings), but the "
                  f"weights hold an {_HEAD} of other values: it is read as the model's own head, as "
                  "transformers reads it. Set tie_word_embeddings to false in config.json to say so.",
                  stacklevel=3)
    return model.clone(tie_embeddings=False)


def _check_tensors(source: Path, architecture: str, model: Module, table: Mapping[str, Any],
                   found: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a missing, left-over or misshapen tensor, naming its key and both shapes."""
    missing = sorted(set(table) - set(found))
    if missing:
        entry = table[missing[0]]
        raise TensorMismatchError(
            f"{source} lacks {len(missing)} tensor(s) the model needs, first {entry.name} "
            f"(shape {entry.hf_shape}, {entry.where} in dew).")
    ignorable = {n for n in found if n.endswith("rotary_emb.inv_freq")}
    if model.tie_embeddings:
        ignorable.add("lm_head.weight")  # some writers keep the tied copy
    extra = sorted(set(found) - set(table) - ignorable)
    if extra:
        raise TensorMismatchError(
            f"{source} holds tensor(s) this {architecture} has no place for: {', '.join(extra[:5])}. "
            "Was the checkpoint saved from another architecture, or does its config.json "
            "describe another model?")
    for name, entry in table.items():
        if tuple(found[name]) != entry.hf_shape:
            shapes = " and ".join(str(shape) for shape in entry.dew_shapes)
            raise TensorMismatchError(
                f"Tensor {name} in {source} has shape {tuple(found[name])}, but config.json makes "
                f"it {entry.hf_shape} ({entry.where} of shape {shapes} in dew).")
