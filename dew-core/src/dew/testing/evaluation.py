"""EvaluationTaskKit: an evaluation task scores a model the same way every time, everywhere.

A task registered in ``dew.evaluations`` scores a ``Subject`` (a causal
model, its variables, its tokenizer) on its own records. Subclass and supply
the task and a small subject::

    class TestMyTask(EvaluationTaskKit):
        def task(self):
            return MyTask(file=...)

        def subject(self):
            return Subject(model, variables, tokenizer)

The tests check that the scores are finite floats and count the records
scored (``records``); that scoring twice gives the same scores; that the
scores do not depend on how many rows one batch holds (``rebatched``, when
the task has such a setting); that the task follows the protocol a run's
schedule calls; and, when ``malformed()`` returns how to build a task over a
file with a bad record, that building or evaluating it fails with an error
naming the line.
"""

from __future__ import annotations

import math
import unittest
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dew.evaluations.base import EvaluationTask, Subject

__all__ = ["EvaluationTaskKit"]


class EvaluationTaskKit:
    """Conformance tests for an evaluation task (see the module docstring)."""

    def task(self) -> EvaluationTask:
        """The task under test."""
        raise NotImplementedError(f"{type(self).__name__} must define task().")

    def subject(self) -> Subject:
        """A dew.evaluations.Subject to score."""
        raise NotImplementedError(f"{type(self).__name__} must define subject().")

    def rebatched(self, rows: int) -> EvaluationTask | None:
        """The same task with rows rows per global batch; None when it has no such setting."""
        return None

    def malformed(self) -> tuple[Callable[[], EvaluationTask], int] | None:
        """A function building a task over a file whose record on the returned line is malformed (a
        task may refuse it as it is built, or as it evaluates); None to skip."""
        return None

    def _scores(self, task: EvaluationTask) -> Mapping[str, float]:
        scores = task.evaluate(self.subject())
        assert isinstance(scores, Mapping) and scores, f"evaluate returned {scores!r}, not a mapping of scores."
        return scores

    def test_scores_are_finite_and_count_records(self) -> None:
        scores = self._scores(self.task())
        for name, value in scores.items():
            assert isinstance(name, str) and "/" not in name, (
                f"Score name {name!r}: a task names its scores plainly; the run adds eval/<task>/.")
            assert isinstance(value, float) and math.isfinite(value), f"Score {name!r} is {value!r}."
        assert scores.get("records", 0) >= 1, f"The scores {dict(scores)} do not count the records scored."

    def test_scores_repeat(self) -> None:
        task = self.task()
        assert dict(self._scores(task)) == dict(self._scores(task)), "Scoring twice gave different scores."

    def test_scores_do_not_depend_on_the_batch(self) -> None:
        one, many = self.rebatched(1), self.rebatched(3)
        if one is None or many is None:
            raise unittest.SkipTest("The task has no batch setting.")
        first, second = self._scores(one), self._scores(many)
        assert first.keys() == second.keys()
        for name in first:
            assert math.isclose(first[name], second[name], rel_tol=1e-6, abs_tol=1e-6), (
                f"Score {name!r} is {first[name]} in batches of 1 row and {second[name]} in batches of 3.")

    def test_follows_the_protocol(self) -> None:
        from dew.evaluations import EvaluationTask

        assert isinstance(self.task(), EvaluationTask), (
            "The task has no evaluate(subject, *, mesh=None); a run's schedule calls exactly that.")

    def test_a_malformed_record_names_its_line(self) -> None:
        given = self.malformed()
        if given is None:
            raise unittest.SkipTest("No malformed task file given.")
        build, line = given
        try:
            build().evaluate(self.subject())
        except Exception as error:  # noqa: BLE001 - any error class, as long as it names the line
            assert f"Line {line}" in str(error) or f"line {line}" in str(error), (
                f"The error {error!r} does not name line {line} of the task file.")
        else:
            raise AssertionError(f"A task file with a malformed record on line {line} was scored.")
