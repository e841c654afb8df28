"""The ``model`` reward: completions scored by a trained reward-model run.

``{"name": "model", "run": "runs/rm"}`` in any RL recipe rebuilds the
reward model that run trained (``RewardModelObjective``, from its run.json),
reads its newest kept step (or ``step``), and scores each completion as the
text ``prompt + completion + suffix``, the prompt being the rollout's
``prompt_text``. ``suffix`` restores what the rollout cut off and the reward
model's pairs ended with (the stop text, ``"\\n"`` for the addition pairs).
Left unset, a completion whose prompt ends as the reward model's chat template
opens an assistant turn is closed as that template closes one (Qwen's
``<|im_end|>\\n``), since its chat pairs were scored there; any other takes none.
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
    suffix: str | None = None
    scale: float = 1.0
    scoring: Any = field(init=False, repr=False, compare=False)
    turn: tuple[str, str] = field(init=False, repr=False, compare=False)  # an assistant turn's opening and close

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
        object.__setattr__(self, "turn", _assistant_turn(scoring.objective.tokenizer))

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        if "prompt_text" not in context:
            raise RewardContextError(
                f"RewardModel(run={self.run!r}) scores each prompt with its completion, but the context "
                f"holds no 'prompt_text' (it holds {sorted(context)}); use it with a rollout that gives "
                "the prompts as text (the GRPO and PPO rollouts do)."
            )
        texts = [f"{prompt}{completion}{self._suffix(prompt)}"
                 for prompt, completion in zip(context["prompt_text"], completions, strict=True)]
        return self.scale * self.scoring(texts)

    def _suffix(self, prompt: str) -> str:
        if self.suffix is not None:
            return self.suffix
        opening, closing = self.turn
        return closing if opening and prompt.endswith(opening) else ""


def _assistant_turn(tokenizer: object) -> tuple[str, str]:
    """What the tokenizer's chat template writes to open an assistant's turn (its generation
    prompt) and to close one after the assistant's text; ("", "") without a template."""
    from dew.data.base import chat_template_of

    template = chat_template_of(tokenizer)
    if template is None:
        return "", ""
    marker = "\x00reply\x00"
    asked = [{"role": "user", "content": "question"}]
    plain = template.text(asked)
    opened = template.text(asked, add_generation_prompt=True)
    answered = template.text([*asked, {"role": "assistant", "content": marker}])
    if not opened.startswith(plain) or marker not in answered:
        return "", ""
    return opened[len(plain):], answered.split(marker, 1)[1]
