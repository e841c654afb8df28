"""A toy task for preference and RL recipes: sums of small numbers, written as bytes.

Every record is one problem ``a+b=`` with its answer ``a+b``, drawn from a
seeded generator, in one of four forms:

- ``"text"``: windows of ``length + 1`` byte ids of solved problems, one per
  line (``"3+4=7\\n12+5=17\\n..."``), for a language model to learn the format;
  with ``calculator`` a seeded share of the problems are written instead as
  episodes of the calculator tool (``dew.environments.calculator``), exactly as
  a rollout lays them out: the question, the opening ``calc(``, the call, the
  tool's value and the question again, then the answer
  (``"3+4=calc(3+4=7\\n3+4=7\\n"``), so a language model learns to call the
  tool and read its result; every window starts where a problem does;
- ``"prompts"``: ``prompt`` (the ids of ``a+b=``, right-padded with 0),
  ``prompt_length`` and ``answer`` (the answer's ids, padded with -1), for a
  rollout to sample completions that a reward checks;
- ``"pairs"``: ``chosen`` (the prompt and the right answer and a newline),
  ``rejected`` (the prompt and a wrong one), their masks over the answer and
  ``prompt_length``, for DPO and reward models;
- ``"labelled"``: ``completion`` (the prompt and the right or a wrong answer
  and a newline), its mask over the answer, ``prompt_length`` and ``label``
  (1 for the right answer, 0 for a wrong one, about half each), for KTO.

A validation split (``val_problems`` records, in the same form) holds what
training never sees: ``held_out`` keeps a fraction of the distinct problems
out of training (the same problems whatever ``problem_seed``), and
``held_out_misses`` the near misses at those distances from the right answer.
The ``pairs`` and ``labelled`` forms' wrong answers are near misses (the
right one moved by 1 to 3, never to a negative number), or with
``misses="any"`` any other number from 0 to twice ``max_operand`` (less the
held-out near misses, which only the validation split holds).

The ids are bytes, so the reader's tokenizer (``text_tokenizer``) is dew's
ByteTokenizer: a recipe hands it to the objective, and every command that
rebuilds the run reads and writes text with it. ``load(val_fraction=...)``
holds a seeded share of the records out for validation (problems repeat among
records: a small ``max_operand`` leaves few, and ``held_out`` keeps problems out).

>>> record = Addition(form="prompts", problems=8, max_operand=9).records()[0]
>>> prompt = bytes(record["prompt"][: record["prompt_length"]].tolist()).decode()
>>> answer = bytes(a for a in record["answer"].tolist() if a >= 0).decode()
>>> a, b = prompt.rstrip("=").split("+")
>>> prompt.endswith("="), int(a) + int(b) == int(answer)
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dew.data.base import Dataset, EosTokenizer, prefix_of
from dew.data.sources import ArrayRecords
from dew.data.stream import record_dataset
from dew.data.videos import load_records

__all__ = ["Addition"]

NEWLINE = ord("\n")
_MISSES = (-3, -2, -1, 1, 2, 3)  # how far a near miss is from the right answer


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _episode(a: int, b: int) -> str:
    """A calculator episode of a+b as a rollout writes it (dew.environments.calculator): the question,
    the opening "calc(", the model's call closed by "=", the tool's value and the question, the answer."""
    return f"{a}+{b}=calc({a}+{b}={a + b}\n{a}+{b}={a + b}\n"


@dataclass(frozen=True)
class Addition:
    """Seeded ``a+b=`` problems with operands in [0, max_operand] (see the module docstring).

    tokenizer ``"byte"`` writes every character as its byte (the default);
    a tokenizer.json path (or an object with ``encode``) writes the same
    text in that tokenizer's ids instead, so a published model's own
    tokenizer reads the problems, and the run hands it to the objective.
    calculator is the share of the text form's problems written as
    calculator episodes (0: plain lines only, 1: episodes only).
    """

    form: Literal["text", "prompts", "pairs", "labelled"] = "text"
    problems: int = 2048
    max_operand: int = 49
    length: int = 32
    problem_seed: int = 0
    held_out: float = 0.0
    held_out_misses: tuple[int, ...] = ()
    misses: Literal["near", "any"] = "near"
    val_problems: int = 256
    tokenizer: Any = "byte"
    calculator: float = 0.0

    def __post_init__(self) -> None:
        if self.problems < 1 or self.max_operand < 1 or self.val_problems < 1:
            raise ValueError(f"Addition needs problems, val_problems and max_operand of at least 1, got "
                             f"{self.problems}, {self.val_problems} and {self.max_operand}.")
        if self.length < 1:
            raise ValueError(f"Addition.length is the ids of each 'text' window (the language model's seq_len), "
                             f"at least 1; got {self.length}.")
        if not 0.0 <= self.held_out < 1.0:
            raise ValueError(f"Addition.held_out is the fraction of problems kept for validation, in [0, 1); "
                             f"got {self.held_out}.")
        if not 0.0 <= self.calculator <= 1.0 or (self.calculator and self.form != "text"):
            raise ValueError(f"Addition.calculator is the share of the 'text' form's problems written as "
                             f"calculator episodes, in [0, 1]; got {self.calculator} with form {self.form!r}.")
        if self.held_out and self.form == "text":
            raise ValueError("Addition.held_out needs a form of one problem per record ('prompts', 'pairs' or "
                             "'labelled'); 'text' windows run across problems.")
        misses = set(self.held_out_misses)
        if misses and (self.form not in ("pairs", "labelled") or not misses < set(_MISSES) or 1 in misses
                       or not any(m > 0 for m in misses)):
            raise ValueError(
                f"Addition.held_out_misses {sorted(misses)} must name distances among {list(_MISSES)}, one of "
                "them positive and none of them 1 (training misses a small sum by +1), for the 'pairs' or "
                f"'labelled' form; got form {self.form!r}.")

    def text_tokenizer(self) -> EosTokenizer:
        """The tokenizer the problems are written in: one id per byte (dew's ByteTokenizer) for
        "byte", else the one tokenizer names."""
        if isinstance(self.tokenizer, str) and self.tokenizer == "byte":
            from dew.data.tokenizers import ByteTokenizer

            return ByteTokenizer()
        from dew.data.token_windows import resolve_tokenizer

        return resolve_tokenizer(self.tokenizer)

    def _encoder(self) -> Callable[[str], list[int]]:
        if isinstance(self.tokenizer, str) and self.tokenizer == "byte":
            return _ids
        tokenizer = self.text_tokenizer()
        return lambda text: [int(i) for i in tokenizer.encode(text)]

    @property
    def _holds_out(self) -> bool:
        return bool(self.held_out or self.held_out_misses)

    def _split(self) -> tuple[np.ndarray, np.ndarray]:
        """Every problem (a, b), split into those trained on and those held out."""
        n = self.max_operand + 1
        every = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), -1).reshape(-1, 2)
        order = np.random.default_rng(2**20).permutation(len(every))  # one split for every problem_seed
        cut = int(round(self.held_out * len(every)))
        return every[np.sort(order[cut:])], every[np.sort(order[:cut])]

    def _operands(self) -> np.ndarray:
        rng = np.random.default_rng(self.problem_seed)
        if not self.held_out:
            return rng.integers(0, self.max_operand + 1, size=(self.problems, 2))
        trained, _ = self._split()
        return trained[rng.integers(0, len(trained), size=self.problems)]

    def records(self) -> ArrayRecords:
        """The records of the chosen form, as columns of numpy arrays."""
        misses = tuple(m for m in _MISSES if m not in self.held_out_misses)
        return self._records(self._operands(), self.problem_seed + 1, misses)

    def val_records(self) -> ArrayRecords | None:
        """Records of what training never sees: held-out problems and near misses (None: nothing held out)."""
        if not self._holds_out:
            return None
        trained, held = self._split()
        pool = held if self.held_out else trained
        rng = np.random.default_rng(self.problem_seed + 3)
        operands = pool[rng.integers(0, len(pool), size=self.val_problems)]
        return self._records(operands, self.problem_seed + 4, tuple(self.held_out_misses) or _MISSES)

    def _records(self, operands: np.ndarray, wrong_seed: int,
                 misses: tuple[int, ...] = ()) -> ArrayRecords:
        ids = self._encoder()
        newline = ids("\n")[-1]
        # A prompt starts as transformers starts one (a beginning-of-text id first, where the
        # tokenizer has one); the text form is running text, cut into windows.
        start = [] if self.form == "text" else prefix_of(self.text_tokenizer())
        prompts = [start + ids(f"{a}+{b}=") for a, b in operands]
        answers = [ids(str(a + b)) for a, b in operands]
        if self.form == "text":
            episode = np.random.default_rng(self.problem_seed + 5).random(len(operands)) < self.calculator
            solved = [ids(_episode(a, b) if tool else f"{a}+{b}={a + b}\n")
                      for (a, b), tool in zip(operands, episode, strict=True)] * 2
            line = np.concatenate(solved)
            starts = np.cumsum([0] + [len(s) for s in solved[:-1]])  # where each problem starts
            starts = starts[starts < len(line) - self.length - 1][: self.problems]
            return ArrayRecords({"text": np.stack([line[s:s + self.length + 1] for s in starts]).astype(np.int32)})
        width = max(map(len, prompts))
        prompt = np.zeros((len(prompts), width), np.int32)
        for i, p in enumerate(prompts):
            prompt[i, : len(p)] = p
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        if self.form == "prompts":
            answer = np.full((len(prompts), max(map(len, answers))), -1, np.int32)
            for i, a in enumerate(answers):
                answer[i, : len(a)] = a
            return ArrayRecords({"prompt": prompt, "prompt_length": lengths, "answer": answer})
        rng = np.random.default_rng(wrong_seed)
        if self.misses == "any" and misses != tuple(self.held_out_misses):  # (the validation split's are near)
            top, kept = 2 * self.max_operand, set(self.held_out_misses)
            wrong = [ids(str(int(rng.choice([v for v in range(top + 1) if v != a + b and v - a - b not in kept]))))
                     for a, b in operands]
        elif not self._holds_out or misses == _MISSES:  # the stream recipes have always read
            wrong = [ids(str(a + b + int(rng.choice(_MISSES)) if a + b > 3 else a + b + 1)) for a, b in operands]
        else:
            small = [m for m in misses if m > 0]
            wrong = [ids(str(a + b + int(rng.choice(misses if a + b > 3 else small)))) for a, b in operands]
        if self.form == "labelled":
            return self._labelled(prompts, answers, wrong, rng.random(len(prompts)) < 0.5, newline)
        full = max(len(p) + max(len(a), len(w)) + 1 for p, a, w in zip(prompts, answers, wrong, strict=True))
        columns = {name: np.zeros((len(prompts), full), np.int32)
                   for name in ("chosen", "rejected", "chosen_mask", "rejected_mask")}
        for i, p in enumerate(prompts):
            for name, completion in (("chosen", answers[i]), ("rejected", wrong[i])):
                row = p + completion + [newline]
                columns[name][i, : len(row)] = row
                columns[f"{name}_mask"][i, len(p): len(row)] = 1
        return ArrayRecords({**columns, "prompt_length": lengths})

    def _labelled(self, prompts: list[list[int]], answers: list[list[int]], wrong: list[list[int]],
                  right: np.ndarray, newline: int) -> ArrayRecords:
        chosen = [a if r else w for a, w, r in zip(answers, wrong, right, strict=True)]
        full = max(len(p) + len(c) + 1 for p, c in zip(prompts, chosen, strict=True))
        completion = np.zeros((len(prompts), full), np.int32)
        mask = np.zeros((len(prompts), full), np.int32)
        for i, (p, c) in enumerate(zip(prompts, chosen, strict=True)):
            row = p + c + [newline]
            completion[i, : len(row)] = row
            mask[i, len(p): len(row)] = 1
        return ArrayRecords({"completion": completion, "completion_mask": mask,
                             "prompt_length": np.asarray([len(p) for p in prompts], np.int32),
                             "label": right.astype(np.int32)})

    def load(self, *, batch: int, seed: int = 0, val_fraction: float = 0.0, val_seed: int = 0,
             workers: int = 0, prefetch: int = 4) -> Dataset:
        """A shuffled, endless, resumable stream of the records, batch rows at a time, and a held-out
        split: the problems held_out/held_out_misses keep from training, else a seeded
        val_fraction of the records (at least one global batch); none when neither is set."""
        if self._holds_out:
            if val_fraction:
                raise ValueError("Addition holds out problems already (held_out or held_out_misses); "
                                 "set data.load.val_fraction only without them.")
            return record_dataset(self.records(), self.val_records(), batch=batch, seed=seed,
                                  workers=workers, prefetch=prefetch)
        return load_records(self.records(), batch=batch, seed=seed, val_fraction=val_fraction,
                            val_seed=val_seed, workers=workers, prefetch=prefetch)
