"""A resumed run reads its weights from its own checkpoint, not from where it started.

A distillation's teacher (teacher_checkpoint) and a recipe's init were read again on every resume,
before the checkpoint was restored, so a run whose teacher run had been moved or removed could not
be resumed at all, though its checkpoints hold the teacher whole.
"""

from __future__ import annotations

import shutil

import pytest

from dew.cli import main

pytestmark = pytest.mark.slow  # three short `dew train` runs, in process

SMALL = ["trainer.steps=1", "trainer.eval_every=null", "trainer.log_every=1", "trackers=[]"]


def test_a_distillation_resumes_after_its_teacher_run_was_moved(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny-lm", "trainer.steps=1", "trainer.checkpoint_dir=teacher", "trackers=[]",
                 "trainer.eval_every=null", "objective.prompt=null"]) == 0
    assert main(["train", "tiny-distill", *SMALL, "trainer.checkpoint_dir=student",
                 "objective.teacher_checkpoint=teacher"]) == 0
    shutil.move(tmp_path / "teacher", tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["train", "--resume", "student", "trainer.steps=2"]) == 0, capsys.readouterr().err
    assert (tmp_path / "student" / "2").is_dir()
