"""Certify an export: transformers loads it on the CPU and computes dew's logits.

``verify(directory, model, variables)`` loads the directory with
``transformers.AutoModelForCausalLM`` in float32 (a reward model's with
``AutoModelForSequenceClassification``, whose score at every position is
compared), runs fixed prompts through it and through dew's own model (also
in float32, on the very weights that were exported), and writes what it
found into the directory as ``verification.json``: the largest absolute
difference of the logits,
the tolerance, the SHA-256 of the prompts, and the versions of the
libraries on both sides. ``dew export --verify`` calls it after writing
and fails when the difference passes the tolerance; the file stays, as the
record of the failure. ``verify_adapters`` does the same for a folder of
PEFT adapters, which ``peft`` puts onto the transformers base their
``adapter_config.json`` names.

transformers and torch (and peft, for adapters) are needed here only
(``pip install transformers torch peft``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.families import scoring
from dew.pretrained.errors import PretrainedError

if TYPE_CHECKING:
    from flax.linen import Module
    from jax import Array

    from dew.data.base import Tokenizer
    from dew.objectives.base import Variables
    from dew.typing import PyTree

__all__ = ["DEFAULT_TOLERANCE", "VERIFICATION_FILE", "ExportMismatchError", "UnrunnableExportError",
           "Verification", "prompts", "verify", "verify_adapters"]

VERIFICATION_FILE = "verification.json"
DEFAULT_TOLERANCE = 1e-3
"""Largest absolute logit difference accepted, in float32 on the CPU."""

_LIBRARIES = ("dew-core", "jax", "jaxlib", "flax", "numpy", "safetensors", "transformers", "torch")
_TEXTS = ("The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
          "12 plus 30 is 42. 7 times 6 is 42 too.")


class ExportMismatchError(PretrainedError):
    """transformers computes other logits from an export than dew does from the same weights."""


class UnrunnableExportError(PretrainedError):
    """transformers (or PEFT) refused to load an export, or to run it on the prompts."""


@contextlib.contextmanager
def _transformers_doing(what: str, target: Path) -> Iterator[None]:
    """Name what transformers was asked to do with the export in target when it raises; its progress
    bars stay off meanwhile (a bar per load on the console, beside dew's one line)."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    except Exception as error:  # noqa: BLE001 - transformers' own errors are of every kind
        said = (str(error).strip().splitlines() or [""])[0][:300]
        raise UnrunnableExportError(
            f"transformers could not {what} the export in {target} ({type(error).__name__}: {said}). The export "
            "was written but is not certified: report it with its config.json.") from error
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


@dataclass(frozen=True)
class Verification:
    """What a verification found: the largest difference, against the tolerance, on which prompts."""

    max_abs_difference: float
    tolerance: float
    passed: bool
    prompts_sha256: str
    prompt_lengths: tuple[int, ...]
    architecture: str
    dtype: str = "float32"
    device: str = "cpu"
    versions: Mapping[str, str] = field(default_factory=dict)

    def write(self, directory: Path) -> Path:
        """The record beside the export, whole or not at all (written beside it, then renamed)."""
        from dew.telemetry.render import write_file

        path = directory / VERIFICATION_FILE
        record = {**asdict(self), "prompt_lengths": list(self.prompt_lengths)}
        try:
            return write_file(path, (json.dumps(record, indent=2) + "\n").encode())
        except OSError as error:
            raise PretrainedError(
                f"{path} could not be written ({error.strerror or error}); the export in {directory} is whole, "
                "without its verification record. Free space on its disk and run dew export --verify "
                "again.") from None


def prompts(vocab_size: int, max_len: int, tokenizer: Tokenizer | None = None) -> list[list[int]]:
    """The fixed prompts: ids drawn from seed 0 (two rows), and fixed texts when a tokenizer is given."""
    length = max(1, min(32, max_len))
    rows = np.random.default_rng(0).integers(0, vocab_size, (2, length)).tolist()
    if tokenizer is not None:
        for text in _TEXTS:
            ids = [int(i) for i in tokenizer.encode(text)][:length]
            if ids and max(ids) < vocab_size:
                rows.append(ids)
    return rows


def _digest(rows: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, r)) for r in rows]).encode()).hexdigest()


def _versions() -> dict[str, str]:
    from dew.versions import installed

    return installed(_LIBRARIES)


def _scores(model: Module, params: PyTree, tokens: Array) -> Array:
    """A reward model's score at each position: its head over the final norm's output."""
    from dew.nn.features import with_features

    decoder = {name: value for name, value in params.items() if name != scoring.HEAD}
    _, hidden = with_features(model, {"params": decoder}, tokens, scoring.FEATURES, head="the score",
                              field="the reward model's features_module")
    return (hidden.astype("float32") @ params[scoring.HEAD]["dense"]["kernel"])[..., 0]


def verify(directory: str | os.PathLike[str], model: Module, variables: Variables, *,
           tokenizer: Tokenizer | None = None, tolerance: float = DEFAULT_TOLERANCE) -> Verification:
    """Compare transformers' logits of the export in directory with dew's; record and return them.

    Raises ExportMismatchError (after writing verification.json) when the
    largest difference passes tolerance.
    """
    try:
        import torch
        import transformers
    except ImportError as error:
        raise PretrainedError(f"Verifying an export needs transformers and torch ({error.name} is "
                              "missing): pip install transformers torch.") from None

    target = Path(directory)
    config = json.loads((target / "config.json").read_text())
    scorer = scoring.is_scorer(config, target / "config.json")
    auto = transformers.AutoModelForSequenceClassification if scorer else transformers.AutoModelForCausalLM
    with _transformers_doing("load", target):
        theirs = auto.from_pretrained(target, dtype=torch.float32).eval()
    return _compare(target, theirs, scorer, str((config.get("architectures") or ["?"])[0]), model, variables,
                    tokenizer=tokenizer, tolerance=tolerance)


def verify_adapters(directory: str | os.PathLike[str], model: Module, variables: Variables, *,
                    tokenizer: Tokenizer | None = None, tolerance: float = DEFAULT_TOLERANCE) -> Verification:
    """Compare what PEFT computes with the adapters in directory on the transformers model their
    adapter_config.json names as base with what dew computes from variables (the adapters merged
    into the same base); record the result in directory and return it, as ``verify`` does for a
    whole model.
    """
    try:
        import peft
        import torch
        import transformers
    except ImportError as error:
        raise PretrainedError(f"Verifying adapters needs peft, transformers and torch ({error.name} is "
                              "missing): pip install peft transformers torch.") from None

    from dew.pretrained.peft import ADAPTER_CONFIG

    target = Path(directory)
    adapter_config = json.loads((target / ADAPTER_CONFIG).read_text())
    base = str(adapter_config.get("base_model_name_or_path") or "")
    source = Path(base)
    if not base:
        raise PretrainedError("The adapters name no base directory (their run started from another run, or from "
                              "a fresh initialization), so PEFT has no model to put them onto; verify the merged "
                              "export instead (dew export without --adapters).")
    if not (source / "config.json").is_file():
        raise PretrainedError(f"The adapters' base {str(source)!r} holds no config.json for transformers to load, "
                              "so PEFT has no model to put them onto; verify the merged export instead "
                              "(dew export without --adapters).")
    scorer = adapter_config.get("task_type") == "SEQ_CLS"
    auto = transformers.AutoModelForSequenceClassification if scorer else transformers.AutoModelForCausalLM
    extra: dict[str, Any] = {"num_labels": 1} if scorer else {}
    with warnings.catch_warnings(record=True) as warned, _transformers_doing("load", target):
        warnings.simplefilter("always")  # PEFT warns, and goes on, where it drops adapters
        wrapped = peft.PeftModel.from_pretrained(auto.from_pretrained(source, dtype=torch.float32, **extra),
                                                 target).eval()
    theirs = wrapped.get_base_model()  # the transformers model, PEFT's LoRA layers put into it
    try:
        return _compare(target, theirs, scorer, f"PeftModel on {type(theirs).__name__}", model, variables,
                        tokenizer=tokenizer, tolerance=tolerance)
    except ExportMismatchError as error:
        said = "; ".join(dict.fromkeys(str(w.message).splitlines()[0] for w in warned))[:500]
        raise ExportMismatchError(f"{error}{f' PEFT warned: {said}' if said else ''}") from None


def _compare(target: Path, theirs: Any, scorer: bool, architecture: str, model: Module, variables: Variables,
             *, tokenizer: Tokenizer | None, tolerance: float) -> Verification:
    """theirs (a torch model) against dew's model on the fixed prompts; the record written into target."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import torch

    exact = model.clone(dtype=jnp.float32, param_dtype=jnp.float32)
    weights = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                           nn.meta.unbox(dict(variables).get("params", variables)))
    rows = prompts(model.vocab_size, model.max_seq_len, tokenizer)
    # One batch, shorter prompts padded at their end: causal attention keeps each prompt's
    # logits what they are alone, and only those positions are compared.
    width = max(len(row) for row in rows)
    ids = np.zeros((len(rows), width), np.int64)
    real = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)], real[i, :len(row)] = row, True
    tokens = jnp.asarray(ids, jnp.int32)
    if scorer:  # the score at every position: transformers pools one of them per row
        mine = np.asarray(jax.jit(functools.partial(_scores, exact))(weights, tokens))
        with torch.no_grad(), _transformers_doing("run", target):
            hidden = getattr(theirs, theirs.base_model_prefix)(torch.from_numpy(ids)).last_hidden_state
            other = theirs.score(hidden)[..., 0].float().numpy()
    else:
        mine = np.asarray(jax.jit(exact.apply)({"params": weights}, tokens))
        with torch.no_grad(), _transformers_doing("run", target):
            other = theirs(torch.from_numpy(ids)).logits.float().numpy()
    worst = float(np.abs(mine - other)[real].max())
    result = Verification(
        max_abs_difference=worst, tolerance=float(tolerance), passed=worst <= tolerance,
        prompts_sha256=_digest(rows), prompt_lengths=tuple(len(r) for r in rows),
        architecture=architecture, versions=_versions())
    result.write(target)
    if not result.passed:
        raise ExportMismatchError(
            f"transformers' {result.architecture} computes {'scores' if scorer else 'logits'} up to {worst:.3g} away from dew's "
            f"on the same weights (tolerance {tolerance:g}); see {target / VERIFICATION_FILE}. The "
            "export was written but does not compute what the run does: report it, with that file.")
    return result
