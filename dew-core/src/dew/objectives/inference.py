"""Pipelines: what a trained objective's weights are for, as every command reaches them.

``objective.pipeline(state)`` wraps trained weights (the EMA copy when the
run kept one) in an inference task: text generation, images for labels,
embeddings. The commands speak to every pipeline through the same three
methods, each declared here with a default that refuses in one line and
says what to use instead:

- ``generate(request)``: samples for ``dew generate`` (texts shown, files
  written), from a ``GenerateRequest`` holding what the user typed;
- ``embed(inputs)``: one vector per input, for ``dew embed``;
- ``pretrained()``: the model, weights and tokenizer ``dew export`` writes
  (``save(directory)`` writes them through ``Pretrained.save``).

A pipeline lists the request options it reads (``options``) and says in a
line what it takes (``accepts``); ``check`` refuses any other option, so a
guidance scale given to a language model fails naming what the model takes
rather than being ignored.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from dew.errors import DewError, out_of_space
from dew.telemetry.render import write_file

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike

    from dew.objectives.base import Objective, Variables
    from dew.pretrained.model import Pretrained
    from dew.training.state import TrainState

__all__ = [
    "Generated",
    "NoPipelineError",
    "NotAPipelineError",
    "Pipeline",
    "PipelineError",
    "GenerateRequest",
    "SampleWriteError",
    "UnsupportedRequestError",
    "served_variables",
    "pipeline_of",
    "variables_of",
    "write_texts",
    "writing_samples",
]


class SampleWriteError(DewError, OSError):
    """Samples could not be written into their folder (a full disk, a read-only folder); texts holds
    the texts generated, for the caller to show rather than lose."""

    def __init__(self, directory: object, reason: OSError, texts: tuple[str, ...] = ()) -> None:
        self.texts = texts
        full = out_of_space(reason)
        advice = "free space on its disk or choose another --out" if full else \
            "choose another --out, a folder (or a name for one) you may write"
        super().__init__(f"The samples could not be written to {directory} ({reason.strerror or reason}); "
                         + advice + ("; the text is printed above." if texts else "."))


@contextlib.contextmanager
def writing_samples(directory: str | os.PathLike[str], texts: tuple[str, ...] = ()) -> Iterator[None]:
    """Within: writes into directory, a refused one raised as SampleWriteError (carrying texts)."""
    try:
        yield
    except OSError as error:
        raise SampleWriteError(directory, error, texts) from None


class PipelineError(DewError, ValueError):
    """A pipeline cannot do what was asked of it."""


class NoPipelineError(PipelineError):
    """An objective that declares no pipeline, so its weights serve no command."""


class NotAPipelineError(PipelineError):
    """An objective's pipeline() returned something other than a Pipeline, or raised NotImplementedError."""


class UnsupportedRequestError(PipelineError):
    """An input or option the pipeline cannot take (a text prompt to a class-conditional model)."""


@dataclass(frozen=True)
class GenerateRequest:
    """What a person asks a pipeline for, as typed: the inputs and the options set.

    inputs are prompts or labels as strings (the pipeline reads them); count
    is how many samples per input (or in all, with no inputs); steps the
    sampler's steps, guidance the classifier-free guidance scale;
    max_new_tokens, the sampling options (temperature, top_k, top_p, min_p),
    the stop strings and chat (each prompt a user turn in the tokenizer's chat
    template, the reply shown alone) are a language model's; seed picks the
    random draws; out is the directory files go to. An option left None takes
    the pipeline's default.
    """

    inputs: tuple[str, ...] = ()
    count: int | None = None
    steps: int | None = None
    guidance: float | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop: tuple[str, ...] = ()
    chat: bool | None = None
    seed: int = 0
    out: Path | None = None

    OPTIONS: ClassVar[tuple[str, ...]] = ("count", "steps", "guidance", "max_new_tokens",
                                          "temperature", "top_k", "top_p", "min_p", "stop", "chat")

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise UnsupportedRequestError(f"count must be at least 1, got {self.count}.")
        if self.steps is not None and self.steps < 1:
            raise UnsupportedRequestError(f"steps must be at least 1, got {self.steps}.")
        if not -(2**63) <= self.seed < 2**63:  # jax.random.key takes a 64-bit integer
            raise UnsupportedRequestError(f"seed must be a 64-bit integer (below 2**63 = 9223372036854775808 "
                                          f"in size), got {self.seed}.")
        for number, text in enumerate((*self.inputs, *self.stop), 1):
            try:  # a shell passes bytes that are no UTF-8 as lone surrogates, which no tokenizer encodes
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                kind = "input" if number <= len(self.inputs) else "stop string"
                raise UnsupportedRequestError(
                    f"The {kind} {text!r} is not UTF-8 text (characters {error.start} to {error.end - 1} are bytes "
                    "your shell passed undecoded); give it as text in UTF-8.") from None

    def given(self) -> tuple[str, ...]:
        """The options set (not None), in declaration order."""
        return tuple(f.name for f in fields(self)
                     if f.name in self.OPTIONS and getattr(self, f.name) not in (None, ()))


@dataclass(frozen=True)
class Generated:
    """What a generation made: texts to show (one per sample) and the files written."""

    texts: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()
    samples: int = 0


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class Pipeline:
    """The inference task of a trained objective (see the module docstring).

    Subclasses set ``accepts`` (one line: what ``generate`` takes) and
    ``options`` (the GenerateRequest options it reads), and implement the methods
    they support; the defaults refuse, naming what to use instead.
    """

    accepts: ClassVar[str] = "nothing: it makes no samples"
    options: ClassVar[frozenset[str]] = frozenset()

    @property
    def name(self) -> str:
        return type(self).__name__

    def describe(self) -> str:
        """One line: what generate takes, and the options it reads."""
        options = ", ".join(_flag(o) for o in GenerateRequest.OPTIONS if o in self.options)
        return f"{self.name} takes {self.accepts}" + (f" (options: {options})" if options else "")

    def check(self, request: GenerateRequest) -> None:
        """Refuse the options this pipeline does not read, in one line naming what it takes."""
        unread = [o for o in request.given() if o not in self.options]
        if unread:
            raise UnsupportedRequestError(
                f"{', '.join(_flag(o) for o in unread)} {'does' if len(unread) == 1 else 'do'} "
                f"not apply here: {self.describe()}.")

    def generate(self, request: GenerateRequest) -> Generated:
        """Samples for request: texts and/or files under request.out."""
        raise UnsupportedRequestError(f"{self.name} makes no samples; {self.instead_of('generate')}")

    def embed(self, inputs: ArrayLike) -> np.ndarray:
        """One vector per input, [N, features]."""
        raise UnsupportedRequestError(f"{self.name} makes no embeddings; {self.instead_of('embed')}")

    def usage(self, run: object) -> str:
        """The command that uses run through this pipeline, as a person would type it."""
        return f"dew generate {run} INPUT..."

    def instead_of(self, command: str) -> str:
        """What to use instead of command on this pipeline (a sentence)."""
        if command == "embed":
            return "use `dew generate RUN ...` for its samples."
        return "use `dew embed RUN INPUTS OUT.npy` for its embeddings."

    def exports(self) -> bool:
        """Whether ``dew export`` can write this pipeline's weights: it implements pretrained()."""
        return type(self).pretrained is not Pipeline.pretrained

    def pretrained(self) -> Pretrained:
        """The model, its variables, tokenizer and task, as ``dew export`` writes them."""
        from dew.objectives.base import PIPELINE_GUIDE

        raise UnsupportedRequestError(f"{self.name} holds no weights to export: implement "
                                      "Pipeline.pretrained() to return a dew.pretrained.Pretrained "
                                      f"({PIPELINE_GUIDE} shows what dew export asks of it).")

    def save(self, directory: str | os.PathLike[str], *, format: str | None = None) -> Path:
        """Write the weights in their source's own format (see Pretrained.save); return directory."""
        return self.pretrained().save(directory, format=format)


def variables_of(state: TrainState | Variables, ema: bool = True) -> Variables:
    """A TrainState's EMA copy (when kept and ema) or its parameters; a variables tree passes through.

    The decode cache a sampler may have left in the variables is dropped.
    """
    if not isinstance(state, Mapping):  # a TrainState
        state = state.averaged if ema and state.averaged is not None else state.params
    return {name: value for name, value in state.items() if name != "cache"}


def served_variables(objective: Objective | None, variables: Variables) -> Variables:
    """What objective's model applies among a run's variables: those its pipeline holds (a
    distillation's student without its teacher, a policy without its value head), or all of them
    for an objective that declares no pipeline or exports no weights (or None: an export that
    records no task). Evaluation tasks score these, as they score the run's export."""
    if objective is None:
        return {name: value for name, value in variables.items() if name != "cache"}
    try:
        return pipeline_of(objective, variables).pretrained().variables
    except PipelineError:
        return {name: value for name, value in variables.items() if name != "cache"}


def write_texts(texts: tuple[str, ...], directory: str | os.PathLike[str] | None) -> tuple[Path, ...]:
    """texts as ``samples.txt`` in directory, separated by rule lines; nothing when directory is None."""
    if directory is None:
        return ()
    target = Path(directory)
    path = target / "samples.txt"
    with writing_samples(target, texts):
        target.mkdir(parents=True, exist_ok=True)
        write_file(path, ("\n---\n".join(texts) + "\n").encode("utf-8"))
    return (path,)


def pipeline_of(objective: Objective, state: TrainState | Variables) -> Pipeline:
    """objective.pipeline(state), checked to be a Pipeline: a plugin's objective that returns
    something else (or raises NotImplementedError) is refused naming it, not met with an
    AttributeError in the command that uses it."""
    name = type(objective).__name__
    try:
        made = objective.pipeline(state)
    except NotImplementedError as error:
        raise NotAPipelineError(f"{name}.pipeline() raised NotImplementedError{f' ({error})' if str(error) else ''}: "
                                "its weights serve no inference command until it returns a "
                                "dew.objectives.inference.Pipeline.") from None
    if not isinstance(made, Pipeline):
        raise NotAPipelineError(f"{name}.pipeline() returned a {type(made).__name__}, not a "
                                "dew.objectives.inference.Pipeline: the commands call generate, embed and "
                                "pretrained on it. Fix the objective's pipeline().")
    return made
