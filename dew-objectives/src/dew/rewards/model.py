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

Where the rollout hands each prompt as the records gave it (the ``prompt_given``
column the ``prompts`` reader keeps), that is scored instead of the policy's
rendering of it, as TRL's GRPO scores: chat messages and the completion as
the assistant's turn (which continues a final assistant turn the prompt
holds), rendered by the reward model's own chat template; a text prompt as
it was written, followed by the completion and the suffix. A reward model of
another family than the policy then reads its own markers and its own
beginning-of-text token, not the policy's. A prompt the policy saw cut (longer
than the data's length) is scored as the policy saw it. An explicit ``suffix``
keeps chat messages in the policy's rendering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.base import PROMPT_GIVEN
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
    template: Any = field(init=False, repr=False, compare=False)  # the reward model's chat template, if any

    def __post_init__(self) -> None:
        from dew.objectives.inference import PipelineError
        from dew.objectives.reward_model import RewardScoring
        from dew.pretrained import CONFIG_FILE
        from dew.pretrained.peft import ADAPTER_CONFIG
        from dew.recipes.opening import (
            open_run,  # the inference commands' way to rebuild a trained run, or read an export
        )

        folder = Path(self.run)
        if (folder / ADAPTER_CONFIG).is_file() and not (folder / CONFIG_FILE).is_file():
            raise NotARewardModelError(
                f"{self.run} holds LoRA adapters alone ({ADAPTER_CONFIG}), not a model to score with: name "
                "the reward-model run they came from, or its merged export (dew export RUN DIR, without "
                "--adapters).")
        opened = open_run(folder, step=self.step)
        try:
            scoring = opened.pipeline()  # a run's objective's, or what an export records as its task
        except PipelineError:
            scoring = None
        if not isinstance(scoring, RewardScoring):
            what = (f"trained {type(opened.objective).__name__}" if opened.objective is not None
                    else "holds no reward model (a language model's weights, say)")
            raise NotARewardModelError(
                f"The reward 'model' reads a reward model, but {self.run} {what}. Name a reward-model run "
                "(the reward_model objective: the addition-reward-model recipe, say), the directory dew export "
                "wrote from one, or a published reward model's folder (a one-label ...ForSequenceClassification)."
            )
        from dew.data.base import chat_template_of

        object.__setattr__(self, "scoring", scoring)
        object.__setattr__(self, "turn", _assistant_turn(scoring.objective.tokenizer))
        object.__setattr__(self, "template", chat_template_of(scoring.objective.tokenizer))

    def __call__(self, completions: Sequence[str], context: Mapping[str, Sequence[Any]]) -> np.ndarray:
        if "prompt_text" not in context:
            raise RewardContextError(
                f"RewardModel(run={self.run!r}) scores each prompt with its completion, but the context "
                f"holds no 'prompt_text' (it holds {sorted(context)}); use it with a rollout that gives "
                "the prompts as text (the GRPO and PPO rollouts do)."
            )
        given = context.get(PROMPT_GIVEN)
        texts = []
        for i, (prompt, completion) in enumerate(zip(context["prompt_text"], completions, strict=True)):
            written = _given(given[i]) if given is not None else None
            if isinstance(written, list) and self.suffix is None and self.template is not None:
                texts.append(self.template.text(_conversation(written, completion)))
                continue
            text = written if isinstance(written, str) else prompt
            texts.append(f"{text}{completion}{self._suffix(text)}")
        return self.scale * self.scoring(texts)

    def _suffix(self, prompt: str) -> str:
        if self.suffix is not None:
            return self.suffix
        opening, closing = self.turn
        return closing if opening and prompt.endswith(opening) else ""


def _given(value: Any) -> str | list[dict[str, Any]] | None:
    """A prompt as the records gave it, from its prompt_given entry (JSON text): a string or chat
    messages (None where the entry holds neither)."""
    import json

    from dew.rewards import _text

    try:
        written = json.loads(_text(value))
    except ValueError:
        return None
    return written if isinstance(written, str | list) else None


def _conversation(messages: list[dict[str, Any]], completion: str) -> list[dict[str, Any]]:
    """The prompt's messages and the completion as the assistant's turn, which continues a final
    assistant turn the prompt holds (a prefilled one), as TRL joins them."""
    final = messages[-1] if messages else {}
    if final.get("role") == "assistant":
        return [*messages[:-1], {**final, "content": f"{final.get('content') or ''}{completion}"}]
    return [*messages, {"role": "assistant", "content": completion}]


def _assistant_turn(tokenizer: object) -> tuple[str, str]:
    """What the tokenizer's chat template writes between a user's text and the assistant's (the
    user turn's close and the generation prompt; Mistral's ``[/INST]``, whose template has no
    generation prompt) and after the assistant's text; ("", "") without a template."""
    from dew.data.base import chat_template_of

    template = chat_template_of(tokenizer)
    if template is None:
        return "", ""
    question, reply = "\x00question\x00", "\x00reply\x00"
    asked = [{"role": "user", "content": question}]
    opened = template.text(asked, add_generation_prompt=True)
    answered = template.text([*asked, {"role": "assistant", "content": reply}])
    if question not in opened or reply not in answered:
        return "", ""
    return opened.split(question, 1)[1], answered.split(reply, 1)[1]
