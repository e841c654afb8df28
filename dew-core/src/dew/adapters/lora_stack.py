"""LoRA targets and adapters on a scanned layer stack (``scan_layers=True``).

A scanned model keeps its layers as one module, ``layers``, whose weights
carry a leading ``layers`` axis; qwix sees that module's path as
``layers/attention`` where the numbered model has ``layers_0/attention``,
``layers_1/attention``, ... . Targets are written for the numbered names
(the presets are), so for a scanned model each pattern is read against the
numbered twin's module paths and every module it matches in all layers is
targeted in the stack. The stack runs one body for every layer, so a
pattern matching some layers of a module and not others cannot be honoured
and is refused. The adapters qwix creates inside the stack are stacked
like its weights (A ``[layers, *inputs, rank]``, B ``[layers, rank,
*outputs]``), so a pipeline's ``stage`` axis splits them with the layers.

>>> import jax.numpy as jnp
>>> from dew.nn.backbones import CausalTransformer
>>> from dew.adapters.lora import Lora
>>> model = CausalTransformer(vocab_size=16, emb_features=8, num_layers=2, num_heads=2,
...                           mlp_features=16, max_seq_len=8, scan_layers=True)
>>> stacked_patterns(model, Lora(targets=("attention",)))
('layers/attention',)
>>> unstack_tree({"layers": {"w": jnp.zeros((2, 3))}, "head": jnp.ones(1)}).keys()
dict_keys(['head', 'layers_0', 'layers_1'])
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dew.nn.sharding import LAYERS

if TYPE_CHECKING:
    from flax.linen import Module

    from dew.adapters.lora import Lora
    from dew.typing import PyTree

__all__ = ["is_scanned", "laid_out_as", "stacked_patterns", "stacked_width_shape", "unstack_tree"]

_NUMBERED = re.compile(rf"{LAYERS}_(\d+)(/.*)?")


def is_scanned(model: Module) -> bool:
    """Whether model keeps its layers as one scanned stack (dew's ``scan_layers`` option)."""
    return bool(getattr(model, "scan_layers", False))  # any flax Module: only dew's decoders scan


def _module_paths(model: Module) -> list[str]:
    """The module paths holding parameters in model (a CausalTransformer-like token model)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from dew.adapters.lora import _weights

    tokens = jnp.zeros((1, 1), jnp.int32)
    abstract = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.key(0), tokens)))
    return sorted({path.rsplit("/", 1)[0] for path in _weights(abstract) if "/" in path})


def stacked_patterns(model: Module, spec: Lora) -> tuple[str, ...]:
    """spec's targets as exact module paths of model's scanned stack (and of its other modules).

    A pattern may name the numbered layers (``.*layers_\\d+/attention``, the
    presets) or the stack itself (``layers/attention``). Raises LoraError
    when a pattern picks a module in some layers and not in others, naming
    the layers, or matches nothing.
    """
    from dew.adapters.lora import LoraError, matched_nothing

    scanned = _module_paths(model)
    numbered = _module_paths(model.clone(scan_layers=False))
    count = int(model.num_layers)
    out: list[str] = []
    for target, pattern in zip(spec.targets, spec.patterns(), strict=True):
        chosen = {path for path in scanned if re.fullmatch(pattern, path)}
        layers: dict[str, set[int]] = {}
        for path in numbered:
            if not re.fullmatch(pattern, path):
                continue
            found = _NUMBERED.fullmatch(path)
            if found is None:
                chosen.add(path)
            else:
                layers.setdefault(f"{LAYERS}{found.group(2) or ''}", set()).add(int(found.group(1)))
        for module, which in sorted(layers.items()):
            if len(which) != count:
                raise LoraError(
                    f"Lora target {target!r} ({pattern}) picks {module} in layers "
                    f"{sorted(which)} of {count}, but this model scans its layers as one stack "
                    "(scan_layers=True), which adapts every layer or none. Write a target that "
                    "matches the module in every layer, or build the model with scan_layers=False.")
            chosen.add(module)
        if not chosen:
            raise matched_nothing(target, pattern, numbered)
        out.extend(sorted(chosen - set(out)))
    return tuple(re.escape(path) for path in out)


def stacked_width_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape one layer's weight has, shape without its leading stack axis for a stacked path."""
    return shape[1:] if path.split("/", 1)[0] == LAYERS else shape


def unstack_tree(params: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """params with a scanned stack (``layers``) split into numbered layers; params as they are without one.

    The count is the stack's leading dimension, so this needs no model;
    every leaf under the stack (adapters and quantized codes alike) is cut
    along it.
    """
    import jax

    if LAYERS not in params or not isinstance(params[LAYERS], Mapping):
        return dict(params)
    from dew.nn.pipeline import unstack_layers

    leaves = jax.tree.leaves(params[LAYERS])
    return unstack_layers(params, int(leaves[0].shape[0]) if leaves else 0)


def laid_out_as(given: Mapping[str, PyTree], fresh: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """given (a params tree) with its layers stacked or numbered as fresh's are.

    A base written by a numbered model (a Hugging Face directory, a run
    without scan_layers) starts a scanned one and the other way round; the
    weights are the same, only their arrangement differs.
    """
    numbered = sorted(key for key in given if _NUMBERED.fullmatch(str(key)))
    if LAYERS in fresh and LAYERS not in given and numbered:
        from dew.nn.pipeline import stack_layers

        return stack_layers(given, len(numbered))
    if LAYERS in given and LAYERS not in fresh and f"{LAYERS}_0" in fresh:
        return unstack_tree(given)
    return dict(given)
