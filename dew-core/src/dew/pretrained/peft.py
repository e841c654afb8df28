"""LoRA adapters in and out, in the layout Hugging Face's PEFT reads and writes.

``save_adapters`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` for the Llama that ``Pretrained.save`` writes
of the same base model: ``peft.PeftModel.from_pretrained(base, directory)``
then computes what dew's adapted model computes. ``load_adapters`` reads
them back onto an adapted model's variables.

Layouts: qwix keeps an adapter as A of shape ``[*inputs, rank]`` and B of
shape ``[rank, *outputs]`` beside a weight whose einsum contracts the
inputs; PEFT keeps ``lora_A.weight`` as ``[rank, in]`` and
``lora_B.weight`` as ``[out, rank]`` beside a torch Linear of weight
``[out, in]``. The Llama tensors flatten dew's input and output dimensions
in the same order (query: ``[embed, heads, head_dim]`` is ``[heads *
head_dim, embed]`` transposed), so each move is a reshape and a transpose.
Both scale the product by ``alpha / rank``. A scanned stack's adapters
(the ``layers`` axis in front) are written and read one layer at a time.

The safetensors file's metadata records a digest of the base weights
(``dew.adapters.lora.base_digest``): adapters put onto another base are
refused, naming both digests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.families import scoring
from dew.pretrained.errors import (
    NoExactCounterpartError,
    NoPretrainedModelError,
    PretrainedError,
    TensorMismatchError,
)
from dew.pretrained.tensors import write_tensors

if TYPE_CHECKING:
    from flax.linen import Module

    from dew.adapters.lora import Lora
    from dew.families.convert import Entry
    from dew.objectives.base import Variables
    from dew.typing import PyTree

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterBaseMismatchError", "load_adapters", "save_adapters"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DIGEST_KEY = "dew_base_digest"
PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix before the transformers model's names


class AdapterBaseMismatchError(PretrainedError):
    """Adapters trained on one base model offered to another (their base digests differ)."""


def _adapted(model: Module) -> dict[tuple[str, ...], str]:
    """dew path of each Linear weight of model's family -> its PEFT module name
    (``model.layers.0.self_attn.q_proj``, DeepSeek's ``kv_a_proj_with_mqa``); a fused Linear
    (Phi-3's qkv_proj) has none, since one PEFT adapter there cannot hold dew's separate ones,
    nor has a routed-experts weight, one dew tensor that many Linears (one per expert) slice,
    nor a weight stored in another order than dew's (_reordered)."""
    return {path: name.removesuffix(".weight") for path, (name, entry) in _linears(model).items()
            if _plain(entry)}


def _linears(model: Module) -> dict[tuple[str, ...], tuple[str, Entry]]:
    """dew path -> (HF name, entry) of each two-dimensional weight its family stores whole."""
    import collections

    from dew.families import of_model

    linears = [(entry.paths[0], name, entry) for name, entry in of_model(model).table(model).items()
               if name.endswith(".weight") and len(entry.paths) == 1 and entry.index is None
               and len(entry.hf_shape) == 2]
    shared = collections.Counter(path for path, _, _ in linears)
    return {path: (name, entry) for path, name, entry in linears if shared[path] == 1}


_PLAIN: dict[tuple[str, tuple[int, ...], tuple[int, ...], object], bool] = {}


def _plain(entry: Entry) -> bool:
    """Whether PEFT's pair (lora_A = A flattened [rank, in], lora_B = B flattened [out, rank])
    computes the change dew's pair makes to this weight: true when the family stores it
    transposed and reshaped only, not with its rows or columns in another order (DeepSeek's
    interleaved rotary features). Checked on one random rank-1 pair, per kind of layer."""
    import re

    # per kind of layer: its name without the layer number, its shapes and the layout's own code
    key = (re.sub(r"\.\d+\.", ".N.", entry.name), tuple(entry.dew_shapes[0]), tuple(entry.hf_shape),
           getattr(entry.layout.to_hf, "__code__", entry.layout.to_hf))
    if key not in _PLAIN:
        shape, (outputs, inputs) = tuple(entry.dew_shapes[0]), entry.hf_shape
        cut = next((k for k in range(1, len(shape)) if int(np.prod(shape[:k])) == inputs
                    and int(np.prod(shape[k:])) == outputs), None)
        if cut is None:
            _PLAIN[key] = False
        else:
            rng = np.random.default_rng(0)
            a, b = rng.normal(size=inputs), rng.normal(size=outputs)
            theirs = np.asarray(entry.layout.to_hf([np.outer(a, b).reshape(shape)]), np.float64)
            _PLAIN[key] = bool(np.allclose(theirs, np.outer(b, a), rtol=1e-6, atol=1e-9))
    return _PLAIN[key]


def _fused(model: Module) -> dict[tuple[str, ...], str]:
    """dew path of each weight that model's family fuses with others -> the fused tensor's name."""
    from dew.families import of_model

    return {path: name for name, entry in of_model(model).table(model).items() if len(entry.paths) > 1
            for path in entry.paths}


def _adapter_paths(params: Mapping[str, PyTree], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every weight in params that has a LoRA adapter (its A)."""
    out: list[tuple[str, ...]] = []
    for key, value in params.items():
        if isinstance(value, Mapping):
            out.extend(_adapter_paths(value, (*prefix, str(key))))
        elif str(key).endswith("_lora_a"):
            out.append((*prefix, str(key).removesuffix("_lora_a")))
    return out


def _node(params: Mapping[str, PyTree], path: tuple[str, ...]) -> Mapping[str, PyTree] | None:
    node: PyTree = params
    for part in path[:-1]:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, Mapping) else None


def save_adapters(directory: str | os.PathLike[str], model: Module, variables: Variables, spec: Lora,
                  *, base_name: str = "", force: bool = False, scored: bool = False) -> Path:
    """Write the adapters of variables (an adapted model's) as a PEFT LoRA directory; return it.

    model is the base CausalTransformer, spec the ``Lora`` the adapters were
    made by, base_name what adapter_config.json records as the base model
    (a path or a hub name; PEFT reads it only when asked to load the base).
    scored: variables are a reward model's (``dew.families.scoring``), whose
    score head trained in full: written as PEFT's sequence-classification
    adapters, the head among its modules_to_save, for the family's one-label
    ForSequenceClassification model of the base. The directory is written
    whole and swapped in, as ``Pretrained.save`` writes (force: the same
    meaning there).
    """
    import flax.linen as nn
    import jax

    from dew.adapters.lora_stack import unstack_tree
    from dew.families import of_model

    of_model(model).config(model)  # refuses a model with no counterpart in its family, naming the field
    # A scanned stack's adapters are written per layer, as PEFT numbers them.
    params = unstack_tree(nn.meta.unbox(dict(variables).get("params", variables)))
    for path, name in _fused(model).items():
        node = _node(params, path)
        if node is not None and f"{path[-1]}_lora_a" in node:
            raise NoExactCounterpartError(
                f"params/{'/'.join(path)} has a LoRA adapter, but its family stores that weight fused "
                f"into {name}, where one PEFT adapter cannot hold dew's separate ones. Export the "
                "merged model instead (dew export without --adapters).")
    tensors: dict[str, np.ndarray] = {}
    targets: set[str] = set()
    written: set[tuple[str, ...]] = set()
    modules: set[str] = set()
    for path, module in _adapted(model).items():
        node = _node(params, path)
        if node is None or f"{path[-1]}_lora_a" not in node:
            continue
        a = np.asarray(jax.device_get(node[f"{path[-1]}_lora_a"]), np.float32)
        b = np.asarray(jax.device_get(node[f"{path[-1]}_lora_b"]), np.float32)
        rank = a.shape[-1]
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.reshape(-1, rank).T
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.reshape(rank, -1).T
        targets.add(module.rsplit(".", 1)[-1])
        written.add(path)
        modules.add(module)
    unwritten = [path for path in _adapter_paths(params) if path not in written]
    if unwritten:  # no PEFT LoRA module computes them as dew does: say which, and why
        linears = _linears(model)
        named = ["/".join(path) for path in unwritten]
        reordered = [f"{'/'.join(path)} ({linears[path][0]})" for path in unwritten if path in linears]
        why = (f"its family stores {', '.join(reordered[:2])} with rows or columns in another order "
               "than dew's, so PEFT's A and B would compute another change" if reordered else
               "they are routed experts' weights, one pair per expert over the stacked tensor, and dew "
               "does not write PEFT's layout for experts' fused parameters (target_parameters)")
        raise NoExactCounterpartError(
            f"{', '.join(named[:3])}{', ...' if len(named) > 3 else ''} ({len(named)} weight(s)) have LoRA "
            f"adapters that no PEFT LoRA module of its family holds: {why}. Export the merged model "
            "instead (dew export without --adapters).")
    _refuse_names_read_as_experts(of_model(model).model_type, modules)
    if not tensors:
        raise TensorMismatchError("The variables hold no LoRA adapters on the family's projections "
                                  "(q/k/v/o_proj, gate/up/down_proj, ...); export the merged model instead.")
    if scored:  # the score, trained in full: PEFT keeps it whole beside the adapters
        from dew.families import scoring

        kernel = params[scoring.HEAD]["dense"]["kernel"]
        tensors[f"{PREFIX}score.weight"] = np.asarray(jax.device_get(kernel), np.float32).T
    target = Path(directory)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if scored else "CAUSAL_LM",
        "base_model_name_or_path": str(base_name),
        "r": int(spec.rank),
        "lora_alpha": float(spec.alpha),
        "lora_dropout": float(spec.dropout),
        **_peft_targets(modules, set(_adapted(model).values()), targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": ["score"] if scored else None,
    }
    from dew.pretrained.writing import replacing

    with replacing(target, force=force) as fresh:
        write_tensors(fresh / ADAPTER_WEIGHTS, tensors, {"format": "pt", DIGEST_KEY: _base_digest(variables)})
        (fresh / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return target


# Model types whose target names PEFT (with transformers 5) takes for the routed experts' fused
# parameters, whatever module a target names: it rewrites them into target_parameters on load, so an
# adapter on a dense MLP or a shared expert by those names is dropped and the base computed there.
_READ_AS_EXPERTS = {
    "qwen3_moe": frozenset({"gate", "gate_proj", "up_proj", "down_proj"}),
    "deepseek_v3": frozenset({"gate", "gate_proj", "up_proj", "down_proj"}),
    "mixtral": frozenset({"gate", "w1", "w2", "w3"}),
}


def _refuse_names_read_as_experts(model_type: str, modules: set[str]) -> None:
    """Refuse adapters on modules whose names PEFT reads as routed experts for model_type."""
    names = _READ_AS_EXPERTS.get(model_type, frozenset())
    dropped = sorted(m for m in modules if m.rsplit(".", 1)[-1] in names)
    if dropped:
        raise NoExactCounterpartError(
            f"{', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''} ({len(dropped)} module(s)) have LoRA "
            f"adapters, but PEFT reads the target names {', '.join(sorted(names))} of a {model_type} model as its "
            "routed experts' fused weights, so it would load no adapter onto them and compute the base model "
            "there. Export the merged model instead (dew export without --adapters), or train LoRA on the "
            "attention alone.")


def _base_digest(variables: Variables) -> str:
    """The digest of the base the adapters go onto: a reward model's score trains beside them, so it is
    no part of that base."""
    from dew.adapters.lora import base_digest

    params = dict(variables).get("params", variables)
    return base_digest({"params": {k: v for k, v in params.items() if k != scoring.HEAD}})


def _peft_targets(modules: set[str], adaptable: set[str], targets: set[str]) -> dict[str, Any]:
    """PEFT's target_modules (and layers_to_transform) adapting exactly the adapted modules: the target
    names, in every layer or in the layers holding them (".*layers_0/attention"); where the modules are
    no such product (attention in one layer, the MLP in another), a pattern PEFT matches each module's
    whole name against, without which it would add adapters the run never trained."""
    import re

    def layer(name: str) -> int | None:
        found = re.search(r"\.layers\.(\d+)\.", name)
        return None if found is None else int(found.group(1))

    numbered = {name: layer(name) for name in adaptable if name.rsplit(".", 1)[-1] in targets}
    if set(numbered) == modules:
        return {"target_modules": sorted(targets)}
    held = {numbered.get(name) for name in modules}
    if None not in held and {name for name, number in numbered.items() if number in held} == modules:
        return {"target_modules": sorted(targets), "layers_to_transform": sorted(n for n in held if n is not None)}
    return {"target_modules": "|".join(re.escape(name) for name in sorted(modules))}


def load_adapters(directory: str | os.PathLike[str], model: Module, variables: Variables,
                  *, spec: Lora | None = None) -> dict[str, PyTree]:
    """variables (an adapted model's, on its base) with the adapters a PEFT directory holds.

    Refuses adapters recorded for another base (AdapterBaseMismatchError,
    naming both digests); an adapter_config.json whose rank or targets are
    not the adapted model's (or whose alpha is not spec's, when given); and
    tensors missing, left over, stored transposed, misshapen or not floats
    (TensorMismatchError, naming the tensor and the file).
    """
    import flax.linen as nn
    from safetensors import safe_open

    from dew.pretrained.reading import check_float_dtype, read_json
    from dew.pretrained.tensors import _header

    source = Path(directory)
    weights = source / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise NoPretrainedModelError(f"{source} holds no {ADAPTER_WEIGHTS}; point at a directory "
                                     "`dew export --adapters` or PEFT's save_pretrained wrote.")
    if not (source / ADAPTER_CONFIG).is_file():
        raise NoPretrainedModelError(f"{source} holds no {ADAPTER_CONFIG}, which says the adapters' rank "
                                     "and targets; copy it beside the weights (PEFT writes both).")
    config = read_json(source / ADAPTER_CONFIG, "adapter config")
    header, _ = _header(weights)
    for name, info in header.items():
        check_float_dtype(weights, name, info["dtype"])
    with safe_open(str(weights), framework="numpy") as handle:
        recorded = (handle.metadata() or {}).get(DIGEST_KEY)
        found = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    mine = _base_digest(variables)
    if recorded is not None and recorded != mine:
        raise AdapterBaseMismatchError(
            f"The adapters in {source} were trained on a base of digest {recorded}, but these variables' "
            f"base has digest {mine}. Load them onto the base they were trained on (the run's "
            "init.pretrained or init.run).")
    _check_config(source, config, model, variables, spec)
    from dew.adapters.lora_stack import is_scanned, unstack_tree

    out = nn.meta.unbox(dict(variables))
    params = unstack_tree(out["params"])  # a scanned stack is filled layer by layer, then stacked again
    used: set[str] = set()
    for path, module in _adapted(model).items():
        a_name, b_name = f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"
        node = _node(params, path)
        if node is None or f"{path[-1]}_lora_a" not in node:
            continue
        if a_name not in found:
            if b_name in found:
                raise TensorMismatchError(f"{source / ADAPTER_WEIGHTS} holds {b_name} but not {a_name}; "
                                          "an adapter needs both. Write the adapters again.")
            raise TensorMismatchError(
                f"{source / ADAPTER_WEIGHTS} has no adapter for {module} (no {a_name}), which the "
                f"adapted model's {'/'.join(path)} carries and {ADAPTER_CONFIG} targets. The file "
                "lacks tensors: write the adapters again.")
        a, b = node[f"{path[-1]}_lora_a"], node[f"{path[-1]}_lora_b"]
        if b_name not in found:
            raise TensorMismatchError(f"{source / ADAPTER_WEIGHTS} holds {a_name} but not {b_name}; "
                                      "an adapter needs both. Write the adapters again.")
        rank = int(np.shape(a)[-1])
        want_a = (rank, int(np.prod(np.shape(a)[:-1])))
        want_b = (int(np.prod(np.shape(b)[1:])), rank)
        for name, want in ((a_name, want_a), (b_name, want_b)):
            have = tuple(found[name].shape)
            if have != want:
                turned = " (stored transposed)" if have == want[::-1] else ""
                raise TensorMismatchError(
                    f"{name} in {source / ADAPTER_WEIGHTS} has shape {have}{turned}; the adapted "
                    f"model's {'/'.join(path)} needs {want} (PEFT's lora_A is [rank, in], lora_B "
                    "[out, rank]). Load adapters of the same rank and targets, written by PEFT or "
                    "`dew export --adapters`.")
        new_a, new_b = found[a_name].T, found[b_name].T
        parent = params
        for part in path[:-1]:
            parent[part] = dict(parent[part])
            parent = parent[part]
        parent[f"{path[-1]}_lora_a"] = np.asarray(new_a.reshape(a.shape), a.dtype)
        parent[f"{path[-1]}_lora_b"] = np.asarray(new_b.reshape(b.shape), b.dtype)
        used.update((a_name, b_name))
    score = f"{PREFIX}score.weight"  # a reward model's score (SEQ_CLS adapters keep it whole)
    head = params.get(scoring.HEAD, {}).get("dense", {}).get("kernel")
    if score in found and head is not None and tuple(found[score].shape) == tuple(np.shape(head))[::-1]:
        params[scoring.HEAD] = {"dense": {"kernel": np.asarray(found[score].T, np.asarray(head).dtype)}}
        used.add(score)
    unused = sorted(set(found) - used)
    if unused:
        raise TensorMismatchError(f"{source} holds adapters this model has no adapter for: "
                                  f"{', '.join(unused[:4])}. Build the model with the same Lora targets.")
    if is_scanned(model):
        from dew.nn.pipeline import stack_layers

        params = stack_layers(params, model.num_layers)
    out["params"] = params
    return out


# adapter_config.json keys whose set values change the adapters' function (PEFT's LoraConfig).
_UNREAD_VARIANTS = ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "layer_replication")


def _check_config(source: Path, config: Mapping[str, Any], model: Module, variables: Variables,
                  spec: Lora | None) -> None:
    """Refuse an adapter_config.json whose rank, targets (or alpha, given spec) are not the model's."""
    import flax.linen as nn

    from dew.adapters.lora_stack import unstack_tree

    where = source / ADAPTER_CONFIG
    if config.get("peft_type", "LORA") != "LORA":
        raise PretrainedError(f"{where} is a {config.get('peft_type')!r} adapter; dew reads LoRA adapters.")
    # PEFT settings that change what the adapters compute, which dew's adapters (alpha / rank
    # times x @ A @ B, one rank and alpha for every weight) do not: refused, never left unapplied.
    variants = [f"{key}={config[key]!r}" for key in _UNREAD_VARIANTS if config.get(key) not in (None, False, {}, "")]
    if variants:
        raise NoExactCounterpartError(
            f"{where} sets {', '.join(variants)}, which dew's LoRA does not compute (it scales every adapter "
            "by lora_alpha / r, with one rank and alpha for every weight, no DoRA magnitude and no rsLoRA "
            "scaling); merge the adapters into the base with PEFT (merge_and_unload) and load that instead.")
    params = unstack_tree(nn.meta.unbox(dict(variables).get("params", variables)))
    ranks, targets, held = set(), set(), set()
    adaptable = _adapted(model)
    for path, module in adaptable.items():
        node = _node(params, path)
        if node is not None and f"{path[-1]}_lora_a" in node:
            ranks.add(int(np.shape(node[f"{path[-1]}_lora_a"])[-1]))
            targets.add(module.rsplit(".", 1)[-1])
            held.add(module)
    rank = config.get("r")
    if ranks and rank not in ranks:
        raise TensorMismatchError(f"{where} sets r={rank!r}, but the adapted model's adapters have rank "
                                  f"{', '.join(map(str, sorted(ranks)))}. Build the model's Lora with "
                                  f"rank={rank!r}, or load adapters of its rank.")
    named = config.get("target_modules")
    if isinstance(named, str):  # PEFT matches each module's whole name against it
        import re

        matched = {module for module in adaptable.values() if re.fullmatch(named, module)}
        if held and matched != held:
            raise TensorMismatchError(f"{where} targets the modules {named!r} matches ({len(matched)}), but the "
                                      f"adapted model carries adapters on {len(held)} others. Build the model's "
                                      "Lora with the same targets, or load adapters made for these.")
        named = targets
    named = set(named or ())
    if targets and named != targets:
        raise TensorMismatchError(f"{where} targets {sorted(named)}, but the adapted model carries "
                                  f"adapters on {sorted(targets)}. Build the model's Lora with the "
                                  "same targets, or load adapters made for these.")
    if spec is not None and config.get("lora_alpha") is not None \
            and float(config["lora_alpha"]) != float(spec.alpha):
        raise TensorMismatchError(f"{where} sets lora_alpha={config['lora_alpha']}, but the Lora "
                                  f"given has alpha={spec.alpha}; the adapters would be scaled "
                                  "differently. Use the same alpha.")
