"""A distillation run holds its teacher beside its student (params/student, params/teacher); what
it is scored and exported as is the student alone. A scheduled evaluation task, `dew eval RUN
--task` and `dew export --verify` were handed the whole tree: the task failed with flax's
ScopeParamNotFoundError traceback at its first evaluation, and --verify was refused as 'dew's own
layout' (the teacher fell outside the Llama table) though the export is Llama's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TEACHER = ["model.num_layers=1", "model.emb_features=32", "model.mlp_features=64", "model.num_heads=2",
           "data.batch=4", "data.files={stdlib}/a*.py", "trackers=[]", "objective.prompt=null",
           "trainer.steps=2", "trainer.checkpoint_dir=teacher"]
STUDENT = ["model.num_layers=1", "model.emb_features=16", "model.mlp_features=32", "model.num_heads=2",
           "objective.teacher.num_layers=1", "objective.teacher.emb_features=32", "objective.teacher.mlp_features=64",
           "objective.teacher.num_heads=2", "objective.teacher_checkpoint=teacher", "objective.seq_len=16",
           "data.length=16", "data.batch=4", "data.files={stdlib}/a*.py", "trainer.eval_every=null",
           "trainer.steps=2", "trainer.checkpoint_dir=student", "trackers=[{name: local, directory: student}]"]


@pytest.mark.slow
def test_a_distillation_run_is_scored_and_verified_as_its_student(tmp_path: Path, dew_command) -> None:
    (tmp_path / "ppl.jsonl").write_text("".join(json.dumps({"text": f"import os{i}\n"}) + "\n" for i in range(6)))
    assert dew_command("train", "tiny-lm", *TEACHER, cwd=tmp_path).returncode == 0
    task = f"trainer.evaluate=[{{task: perplexity, file: {tmp_path / 'ppl.jsonl'}, label: ppl}}]"
    trained = dew_command("train", "tiny-distill", *STUDENT, task, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "student" / "scalars.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "eval/ppl/token_perplexity" in row]
    assert [row["step"] for row in logged] == [2], rows

    exported = dew_command("export", "student", "exported", "--verify", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "llama layout" in exported.stdout and "Verified: transformers' LlamaForCausalLM" in exported.stdout
    assert "Loading weights" not in exported.stderr  # transformers' progress bar, beside dew's one line

    # The export holds the student alone, read by its own path (Pretrained): the run scores as it does.
    scores = {}
    for source in ("student", "exported"):
        done = dew_command("eval", source, "--task", "perplexity", "--set", f"file={tmp_path / 'ppl.jsonl'}",
                           "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        scores[source] = json.loads(done.stdout.strip().splitlines()[-1])
    assert scores["student"]["eval/perplexity/token_perplexity"] == pytest.approx(
        scores["exported"]["eval/perplexity/token_perplexity"], rel=1e-5)
    assert logged[0]["eval/ppl/token_perplexity"] == pytest.approx(
        scores["exported"]["eval/perplexity/token_perplexity"], rel=1e-5)
