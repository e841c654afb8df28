"""What each shipped recipe's objective validates under stores in MLflow's file store, whose layout
keeps one file per metric name: a name that is another's folder ("val/loss" beside
"val/loss/noise_0") failed every batch after it, and the run ended FINISHED without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dew.recipes.config import RunConfig, recipe_path
from dew.recipes.run import build_parts

pytest.importorskip("mlflow")

# These need files a person makes first (a reward model run, a converted checkpoint's tokenizer).
_NEEDS_FILES = {"addition-grpo-rm", "gemma-grpo", "qwen3-sft"}
RECIPES = sorted(path.stem for path in Path(recipe_path("tiny-lm")).parent.glob("*.yaml")
                 if path.stem not in _NEEDS_FILES)


def test_every_shipped_objectives_validation_names_read_back_from_mlflows_file_store(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from dew.trackers.mlflow import MLflowTracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it beside a database
    names = {f"val/{metric.name}" for recipe in RECIPES
             for metric in build_parts(RunConfig.load(recipe), with_data=False).objective.metrics()}
    assert "val/loss_noise_3" in names  # the diffusion recipes' per-noise losses are among them
    uri = (tmp_path / "mlruns").as_uri()
    tracker = MLflowTracker("names", "names", uri=uri)
    tracker.log({name: float(index) for index, name in enumerate(sorted(names))}, step=1)
    tracker.log({"train/loss": 2.0}, step=2)  # a later step is not lost behind them
    tracker.close()

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("names").experiment_id])
    logged = {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
              for name in [*sorted(names), "train/loss"]}
    assert logged == {**{name: [(1, float(index))] for index, name in enumerate(sorted(names))},
                      "train/loss": [(2, 2.0)]}
