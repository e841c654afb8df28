"""A toy task for preference and RL recipes: sums of small numbers, written as bytes.

Every record is one problem ``a+b=`` with its answer ``a+b``, drawn from a
seeded generator, in one of three forms:

- ``"text"``: windows of ``length + 1`` byte ids of solved problems, one per
  line (``"3+4=7\\n12+5=17\\n..."``), for a language model to learn the format;
- ``"prompts"``: ``prompt`` (the ids of ``a+b=``, right-padded with 0),
  ``prompt_length`` and ``answer`` (the answer's ids, padded with -1), for a
  rollout to sample completions that a reward checks;
- ``"pairs"``: ``chosen`` (the prompt and the right answer and a newline),
  ``rejected`` (the prompt and a wrong one), their masks over the answer and
  ``prompt_length``, for DPO.

The ids are bytes, so the reader's tokenizer (``text_tokenizer``) is dew's
ByteTokenizer: a recipe hands it to the objective, and every command that
rebuilds the run reads and writes text with it. ``load(val_fraction=...)``
holds a seeded share of the problems out for validation.

>>> record = Addition(form="prompts", problems=8, max_operand=9).records()[0]
>>> prompt = bytes(record["prompt"][: record["prompt_length"]].tolist()).decode()
>>> answer = bytes(a for a in record["answer"].tolist() if a >= 0).decode()
>>> a, b = prompt.rstrip("=").split("+")
>>> prompt.endswith("="), int(a) + int(b) == int(answer)
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dew.data.base import Dataset
from dew.data.sources import ArrayRecords
from dew.data.videos import load_records

__all__ = ["Addition"]

NEWLINE = ord("\n")


def _ids(text: str) -> list[int]:
    return list(text.encode())


@dataclass(frozen=True)
class Addition:
    """Seeded ``a+b=`` problems with operands in [0, max_operand] (see the module docstring)."""

    form: Literal["text", "prompts", "pairs"] = "text"
    problems: int = 2048
    max_operand: int = 49
    length: int = 32
    problem_seed: int = 0

    def __post_init__(self) -> None:
        if self.problems < 1 or self.max_operand < 1:
            raise ValueError(f"Addition needs problems >= 1 and max_operand >= 1, got {self.problems} "
                             f"and {self.max_operand}.")

    def _operands(self) -> np.ndarray:
        return np.random.default_rng(self.problem_seed).integers(0, self.max_operand + 1, size=(self.problems, 2))

    def records(self) -> ArrayRecords:
        """The records of the chosen form, as columns of numpy arrays."""
        operands = self._operands()
        prompts = [_ids(f"{a}+{b}=") for a, b in operands]
        answers = [_ids(str(a + b)) for a, b in operands]
        if self.form == "text":
            line = np.concatenate([_ids(f"{a}+{b}={a + b}\n") for a, b in operands] * 2)
            starts = np.flatnonzero(np.r_[True, line[:-1] == NEWLINE][: len(line) - self.length - 1])
            starts = starts[: self.problems]
            return ArrayRecords({"text": np.stack([line[s:s + self.length + 1] for s in starts]).astype(np.int32)})
        width = max(map(len, prompts))
        prompt = np.zeros((self.problems, width), np.int32)
        for i, p in enumerate(prompts):
            prompt[i, : len(p)] = p
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        if self.form == "prompts":
            answer = np.full((self.problems, max(map(len, answers))), -1, np.int32)
            for i, a in enumerate(answers):
                answer[i, : len(a)] = a
            return ArrayRecords({"prompt": prompt, "prompt_length": lengths, "answer": answer})
        rng = np.random.default_rng(self.problem_seed + 1)
        wrong = [_ids(str(a + b + int(rng.choice([-3, -2, -1, 1, 2, 3])) if a + b > 3 else a + b + 1))
                 for a, b in operands]
        full = max(len(p) + max(len(a), len(w)) + 1 for p, a, w in zip(prompts, answers, wrong, strict=True))
        columns = {name: np.zeros((self.problems, full), np.int32)
                   for name in ("chosen", "rejected", "chosen_mask", "rejected_mask")}
        for i, p in enumerate(prompts):
            for name, completion in (("chosen", answers[i]), ("rejected", wrong[i])):
                row = p + completion + [NEWLINE]
                columns[name][i, : len(row)] = row
                columns[f"{name}_mask"][i, len(p): len(row)] = 1
        return ArrayRecords({**columns, "prompt_length": lengths})

    def text_tokenizer(self) -> Any:
        """The tokenizer the ids are written in: one id per byte (dew's ByteTokenizer)."""
        from dew.data.tokenizers import ByteTokenizer

        return ByteTokenizer()

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A shuffled, endless, resumable stream of the records, batch rows at a time; a seeded
        val_fraction of the problems held out (at least one global batch) for validation."""
        return load_records(self.records(), batch=batch, seed=seed, val_fraction=val_fraction,
                            val_seed=val_seed, workers=workers, prefetch=prefetch)
