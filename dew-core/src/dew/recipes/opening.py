"""A trained model rebuilt for inference from a run folder or an exported directory.

A run folder (``run.json`` beside the checkpoints, as ``dew train`` writes
it) gives the model, objective and tokenizer again from its recipe, and the
parameters alone of a kept step (the EMA copy too when the run kept one); an
exported directory (``config.json`` and the weights, as ``dew export`` or
transformers writes them) gives them from the export. The inference commands
and a model reward open runs through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dew.errors import DewError
from dew.tree_summary import brief_repr

if TYPE_CHECKING:
    from flax import linen as nn

    from dew.checkpoints.store import Store
    from dew.data.base import Tokenizer
    from dew.objectives.base import Objective, Variables
    from dew.objectives.inference import Pipeline
    from dew.pretrained.model import Pretrained
    from dew.recipes.config import RunConfig

__all__ = ["NoCheckpointError", "NotARunError", "Opened", "open_run"]


class NotARunError(DewError, FileNotFoundError):
    """The directory is neither a run (run.json) nor an exported model (config.json)."""


class NoCheckpointError(DewError, FileNotFoundError):
    """The run directory holds no kept checkpoint step to read weights from."""


@dataclass(frozen=True)
class Opened:
    """A trained model ready for inference, and where it came from.

    variables are what inference uses: the EMA copy when the run kept one,
    else the live parameters; live holds the live parameters either way and
    averaged the EMA copy (None when none was kept). An exported directory
    keeps what Pretrained.load read of it (pretrained).
    """

    model: nn.Module
    objective: Objective | None  # None for an exported directory that records no task
    tokenizer: Tokenizer | None
    variables: Variables
    step: int | None
    config: RunConfig | None  # None for an exported directory
    source: Path
    live: Variables | None = None
    averaged: Variables | None = None
    pretrained: Pretrained | None = None

    __repr__ = brief_repr  # each variable tree as one line, not every array

    def pipeline(self) -> Pipeline:
        """The inference task of these weights: the objective's pipeline, or the export's task's
        (an export that records none, and is no language model, is refused naming that)."""
        if self.objective is None:
            assert self.pretrained is not None  # an export without a task is what opened it
            return self.pretrained.pipeline()
        from dew.objectives.inference import pipeline_of

        return pipeline_of(self.objective, self.variables)


def _read_variables(objective: Objective, directory: Path, step: int | None
                    ) -> tuple[Variables, Variables | None, int]:
    """The parameters alone of step (newest when None), live and EMA (None when not kept).

    Only reads: a run still training may be writing its next step beside the
    kept ones, and nothing here touches it. Such a run also removes its oldest
    kept step as it saves a new one: a newest step removed while it was read
    is read again at the new newest.
    """
    from dew.checkpoints.store import Store

    store = Store(directory, local=False)
    for _ in range(_READS):
        kept = store.committed()
        if not kept:
            raise NoCheckpointError(
                f"The run {directory} has no checkpoint: looked in {directory}, which holds no "
                "committed step. Train with trainer.checkpoint_dir set (shipped recipes do) until "
                "the run reaches a checkpoint step."
            )
        number = kept[-1] if step is None else int(step)
        if number not in kept:
            raise NoCheckpointError(f"The run {directory} kept no step {number}; it keeps {kept}.")
        try:
            return _read_step(objective, directory, store, kept, number)
        except Exception:
            if store.step_path(number).exists():  # there still: what went wrong is the step's own
                raise
            if step is not None:
                raise NoCheckpointError(
                    f"Step {number} of {directory} was removed while it was read: the run is still training "
                    "and keeps only its newest steps (trainer.keep). Read a newer step, or drop --step for "
                    "the newest.") from None
            # The newest step, removed by the run still writing beside it: read the newest again.
    raise NoCheckpointError(f"The newest step of {directory} was removed {_READS} times while it was read: "
                            "the run still training keeps fewer steps than a read takes. Read it when the "
                            "run has stopped, or train with a larger trainer.keep.")


_READS = 5  # tries at the newest step of a run still training, whose oldest kept steps it removes


def _read_step(objective: Objective, directory: Path, store: Store, kept: list[int], number: int
               ) -> tuple[Variables, Variables | None, int]:
    import flax.linen as nn
    import jax

    from dew.checkpoints.errors import CheckpointCorruptedError
    from dew.checkpoints.restore import read_manifest
    from dew.training.initializers import ParamsFrom

    try:  # a damaged manifest, or a file of the step that is short or fails its checksum
        manifest = read_manifest(store.step_path(number), number)
        leaves = [leaf.path for leaf in manifest.leaves]
        abstract = nn.meta.unbox(jax.eval_shape(objective.init, jax.random.key(0)))
        live = ParamsFrom(directory, step=number)(abstract)
        averaged = None
        if any(name.startswith(".ema[") for name in leaves):
            from dew.training.trees import overlay_as

            # in the weights' dtypes: an EMA is kept in float32 over bfloat16 or float16 weights
            averaged = overlay_as(live, ParamsFrom(directory, step=number, field="ema")(abstract))
    except CheckpointCorruptedError as error:
        from dew.checkpoints.restore import intact

        others = [kept_step for kept_step in kept if kept_step != number]
        good = next((s for s in reversed(others) if intact(store.step_path(s), s)), None)  # what a resume takes
        if good is not None:
            hint = (f"read an intact kept step with --step {good} (kept: {kept}), or resume the run "
                    f"(dew train --resume), which trains on from step {good}")
        else:
            none = f"no other kept step is intact (kept: {kept})" if others else "no other step is kept"
            hint = (f"{none}, so the run cannot be resumed: restore its steps' files from a copy, or train it "
                    "again in a new folder")
        raise CheckpointCorruptedError(error.step, error.file, f"{error.reason}; {hint}") from None
    return live, averaged, number


def open_run(path: Path, *, step: int | None = None, max_seq_len: int | None = None) -> Opened:
    """Rebuild model, objective, tokenizer and variables from a run or an exported directory."""
    from dew.pretrained import CONFIG_FILE
    from dew.recipes.config import RUN_FILE

    path = Path(path).expanduser().resolve()
    if (path / RUN_FILE).is_file():
        return _open_trained(path, step)
    if (path / CONFIG_FILE).is_file():
        if step is not None:
            raise NotARunError(f"{path} is an exported model, which keeps no steps, so --step {step} has "
                               "nothing to choose; drop --step, or give the run's own directory to read "
                               "one of its kept steps.")
        return _open_exported(path, max_seq_len)
    if not path.exists():
        raise NotARunError(f"{path} does not exist. Give a run's directory (its trainer.checkpoint_dir) or a "
                           "model `dew export` or transformers wrote.")
    if not path.is_dir():  # a run's or a model's file named in place of its folder (run.json, config.json)
        within = (f"; give the folder that holds it, {path.parent}" if path.name in (RUN_FILE, CONFIG_FILE)
                  else "")
        raise NotARunError(f"{path} is a file, not a directory: a run's directory (its trainer.checkpoint_dir) or "
                           f"an exported model's is what is read{within}.")
    damaged = [name for name in (RUN_FILE, CONFIG_FILE) if (path / name).exists()]
    if damaged:  # there, but not a file: the folder was damaged or put together by hand
        raise NotARunError(f"{path / damaged[0]} is not a file (a directory, or something else), so {path} "
                           f"holds no readable {damaged[0]}; restore the file from the run or export it came from.")
    from dew.recipes.resuming import the_run_folder

    raise NotARunError(
        f"{path} holds neither {RUN_FILE} (a run `dew train` wrote, with checkpoint_dir set) nor "
        f"{CONFIG_FILE} (a model `dew export` or transformers wrote).{the_run_folder(path)}"
    )


def _open_exported(path: Path, max_seq_len: int | None) -> Opened:
    from dew import registry
    from dew.nn.backbones import CausalTransformer
    from dew.pretrained import Pretrained

    loaded = Pretrained.load(path, max_seq_len=max_seq_len)
    objective = None
    if loaded.task is None and isinstance(loaded.model, CausalTransformer):  # a language model
        objective = registry.objectives.build("lm", model=loaded.model,
                                              seq_len=loaded.model.max_seq_len,
                                              tokenizer=loaded.tokenizer)
    return Opened(loaded.model, objective, loaded.tokenizer, loaded.variables, None, None, path,
                  loaded.variables, pretrained=loaded)


def _open_trained(path: Path, step: int | None) -> Opened:

    from dew.recipes.config import RunConfig
    from dew.recipes.resuming import installing_what_it_trained_with, started_in
    from dew.recipes.run import build_parts

    with installing_what_it_trained_with(path):
        config = RunConfig.read(path)
    with started_in(path):  # its recipe's relative paths (a tokenizer file) start where it trained
        try:
            parts = build_parts(config, with_data=False)
        except DewError as error:  # a file the run read when it trained (its tokenizer) moved since
            from dew.recipes.config import RUN_FILE
            from dew.recipes.named_paths import fields_naming

            for field, _ in fields_naming(config, error, cwd=Path.cwd(), timestamp=None):
                if field.startswith("init."):  # the starting weights are in the run's checkpoints now
                    continue
                error.add_note(f"The run's recipe ({path / RUN_FILE}) names it at {field}: put it back where it "
                               f"was, or set {field} in that file to where it is now.")
            raise
    live, averaged, number = _read_variables(parts.objective, path, step)
    return Opened(parts.model, parts.objective, parts.tokenizer,
                  averaged if averaged is not None else live, number, config, path, live, averaged)
