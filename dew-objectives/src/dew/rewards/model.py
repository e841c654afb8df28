"""The ``model`` reward: completions scored by a trained reward-model run.

``{"name": "model", "run": "runs/rm"}`` in any RL recipe rebuilds the
reward model that run trained (``RewardModelObjective``, from its run.json),
reads its newest kept step (or ``step``), and scores each completion as the
text ``prompt + completion + suffix``, the prompt being the rollout's
``prompt_text``. ``suffix`` restores what the rollout cut off and the reward
model's pairs ended with (the stop text, ``"\\n"`` for the addition pairs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dew.errors import DewError
from dew.rewards import RewardContextError

__all__ = ["NotARewardModelError", "RewardModel"]


class NotARewardModelError(DewError, ValueError):
    """The run a ``model`` reward names did not train a reward model."""


@dataclass(frozen=True)
class RewardModel:
    """Score completions with the reward model a run trained (see the module docstring)."""

    run: str
    step: int | None = None
    suffix: str = ""
    scale: float = 1.0
    scoring: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from dew.objectives.inference import PipelineError
        from dew.objectives.reward_model import RewardScoring
        from dew.recipes.opening import (
            open_run,  # the inference commands' way to rebuild a trained run, or read an export
        )

        opened = open_run(Path(self.run), step=self.step)
        try:
            scoring = opened.pipeline()  # a run's objective's, or what an export records as its task
        except PipelineError:
            scoring = None
        if not isinstance(scoring, RewardScoring):
            what = (f"trained {type(opened.objective).__name__}" if opened.objective is not None
                    else "is an export of no reward model")
            raise NotARewardModelError(
                f"The reward 'model' reads a reward-model run (or its export), but {self.run} {what}. Train "
                "one with the reward_model objective (the addition-reward-model recipe, say) and name its "
                "run directory, or the directory dew export wrote from it."
            )
        object.__setattr__(self, "scoring", scoring)

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        if "prompt_text" not in context:
            raise RewardContextError(
                f"RewardModel(run={self.run!r}) scores each prompt with its completion, but the context "
                f"holds no 'prompt_text' (it holds {sorted(context)}); use it with a rollout that gives "
                "the prompts as text (the GRPO and PPO rollouts do)."
            )
        texts = [f"{prompt}{completion}{self.suffix}"
                 for prompt, completion in zip(context["prompt_text"], completions, strict=True)]
        return self.scale * self.scoring(texts)
