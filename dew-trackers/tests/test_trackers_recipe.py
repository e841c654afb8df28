"""The recipe in every tracker: a `dew train` run whose trackers were named in the recipe
(TensorBoard, MLflow with a run name) and through trainer.wandb, read back through each
tracker's own reader, shows the recipe's fields under their dotted names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

from wandb_datastore import finished_records  # noqa: E402 - a helper beside the tests

DEW = Path(sys.executable).with_name("dew")
RECIPE = Path(__file__).resolve().parents[2] / "dew-core/src/dew/recipes/tiny-lm.yaml"


EVERY_LOG = ("train/loss", "train/accuracy", "train/lr", "train/grad_norm")
# Timed from the end of the first step's compile at the first log step, from the previous log after.
THROUGHPUT = ("train/step_time", "throughput/tokens_per_second",
              "throughput/examples_per_second", "throughput/steps_per_second")


@pytest.mark.slow
def test_the_recipe_reaches_every_tracker_as_searchable_fields(tmp_path):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["data"]["files"] = "{stdlib}/a*.py"
    recipe["trainer"].update(steps=2, log_every=1, wandb={
        "project": "dew-recipe", "name": "wandb-named", "offline": True})
    recipe["trackers"] = [
        {"name": "tensorboard", "directory": str(tmp_path / "tb")},
        {"name": "mlflow", "experiment": "dew-recipe", "uri": mlflow_uri,
         "run_name": "mlflow-named"},
    ]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true", "WANDB_API_KEY": ""}
    env.pop("WANDB_MODE", None)
    result = subprocess.run([str(DEW), "train", str(tmp_path / "recipe.yaml")],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]

    # MLflow: the run's parameters, and the name the recipe gave it.
    client = MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dew-recipe").experiment_id])
    assert run.info.run_name == "mlflow-named"
    params = run.data.params
    assert params["trainer.steps"] == "2" and params["model.name"] == "causal_transformer"
    assert params["model.num_layers"] == "2" and params["optimizer.solver"] == "adamw"
    assert params["trackers.1.run_name"] == "mlflow-named"
    assert params["trainer.wandb.project"] == "dew-recipe"
    searched = client.search_runs([run.info.experiment_id],
                                  filter_string="params.`optimizer.solver` = 'adamw'")
    assert [r.info.run_id for r in searched] == [run.info.run_id]
    # ... and the step's scalars under the conventional names (docs/metrics.md).
    for name in EVERY_LOG + THROUGHPUT:
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [1, 2], name

    # TensorBoard: the hparams plugin's session holds the same fields.
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["trainer.steps"].number_value == 2
    assert hparams["model.name"].string_value == "causal_transformer"
    assert hparams["optimizer.learning_rate"].number_value == pytest.approx(3e-3)
    assert hparams["trainer.wandb.name"].string_value == "wandb-named"
    assert set(EVERY_LOG + THROUGHPUT) <= set(events.Tags()["scalars"])

    # W&B (named through trainer.wandb): the run's config in its offline datastore.
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (datastore,) = run_dir.glob("run-*.wandb")
    records = finished_records(datastore)
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = (record.run.config.update if kind == "run" else
                   record.config.update if kind == "config" else [])
        config.update({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                       for item in updates})
    (named,) = [r.run.display_name for r in records if r.WhichOneof("record_type") == "run"]
    assert named == "wandb-named"
    assert config["trainer.steps"] == 2 and config["model.name"] == "causal_transformer"
    assert config["trackers.1.run_name"] == "mlflow-named"
    logged = {item.key or "/".join(item.nested_key) for record in records
              if record.WhichOneof("record_type") == "history" for item in record.history.item}
    assert set(EVERY_LOG + THROUGHPUT) <= logged, logged


def test_a_trackers_entry_names_its_run_with_run_name():
    from dew.recipes.components import problems_of
    from dew.registry import trackers

    for name, fields in (("mlflow", {"experiment": "e"}), ("wandb", {"project": "p"})):
        assert problems_of("trackers", name, {**fields, "run_name": "wider-mlp"}) == []
        assert trackers.build(name, **fields, run_name="wider-mlp").name == "wider-mlp"
        with pytest.raises(ValueError, match="two run names"):
            trackers.load(name)(*fields.values(), "one", run_name="other")


def test_recipe_fields_mlflow_would_refuse_become_names_it_takes(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from dew.telemetry.records import RunStarted
    from dew.trackers.mlflow import MLflowTracker

    monkeypatch.chdir(tmp_path)  # a SQLite store keeps its artifacts in ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker("dew-names", run_name="names", uri=uri)
    tracker.log({"loss": 1.0}, step=1)
    tracker.artifact(RunStarted({"data": {"load": {"split:train": 1}}, "x" * 300: 2}, 0, 2), 0)
    tracker.log({"loss": 0.5}, step=2)
    tracker.close()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dew-names").experiment_id])
    assert run.data.params == {"data.load.split_train": "1", "x" * 250: "2"}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]


@pytest.mark.slow
def test_dew_train_resume_continues_the_mlflow_and_wandb_runs_it_started(tmp_path):
    # The resume reopens the run the first fit started rather than starting a second. The recipe
    # names its folder as the shipped ones do, runs/{timestamp}: each tracker took that text for the
    # folder, so a resume started a new W&B run and reopened the newest MLflow run of the recipe
    # (another run's), logging its steps there.
    from mlflow import MlflowClient

    from dew.trackers.wandb import RUN_ID_FILE

    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["data"]["files"] = "{stdlib}/a*.py"
    recipe["trainer"].update(steps=2, log_every=1, checkpoint_dir="runs/{timestamp}")
    recipe["trackers"] = [{"name": "mlflow", "experiment": "dew-resume", "uri": mlflow_uri},
                          {"name": "wandb", "project": "dew-resume", "offline": True}]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}

    def dew(*command):
        result = subprocess.run([str(DEW), *command], capture_output=True, text=True, timeout=600,
                                cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stdout + result.stderr[-4000:]
        # MLflow will not change a parameter: the folder the resume writes absolute was refused, and with
        # it the whole batch of parameters (an override's among them), on every resume
        assert "could not record the recipe" not in result.stderr, result.stderr[-3000:]

    dew("train", str(tmp_path / "recipe.yaml"))
    (first,) = (tmp_path / "runs").iterdir()
    dew("train", str(tmp_path / "recipe.yaml"), "seed=1")  # another run of the recipe, started later
    (other,) = set((tmp_path / "runs").iterdir()) - {first}
    wandb_id = json.loads((first / RUN_ID_FILE).read_text())["id"]
    assert json.loads((other / RUN_ID_FILE).read_text())["id"] != wandb_id
    dew("train", "--resume", str(first.relative_to(tmp_path)), "trainer.steps=4", "optimizer.learning_rate=0.001")
    assert json.loads((first / RUN_ID_FILE).read_text())["id"] == wandb_id  # the same W&B run went on
    client = MlflowClient(tracking_uri=mlflow_uri)
    runs = {run.data.tags["dew.checkpoint_dir"]: run
            for run in client.search_runs([client.get_experiment_by_name("dew-resume").experiment_id])}
    assert set(runs) == {str(first), str(other)}
    run = runs[str(first)]
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.checkpoint_dir"] == "runs/{timestamp}"  # as the recipe wrote it
    assert run.data.tags["dew.resumed_at.2.optimizer.learning_rate"] == "0.001"  # what the resume changed
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2, 3, 4]
    assert sorted(m.step for m in client.get_metric_history(runs[str(other)].info.run_id, "train/loss")) == [1, 2]


@pytest.mark.slow
def test_a_tracker_address_that_fails_is_named_and_not_the_folder_it_lies_in(tmp_path):
    # MLflow refuses a file store under the run's folder: the note named trackers.0.directory (the
    # folder is part of the address) and told the user to make it writable.
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["data"]["files"] = "{stdlib}/a*.py"
    run = tmp_path / "base"
    recipe["trainer"].update(steps=2, checkpoint_dir=str(run))
    recipe["trackers"] = [{"name": "local", "directory": str(run)},
                          {"name": "mlflow", "experiment": "x", "uri": f"file://{run}/mlruns"}]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = {key: value for key, value in os.environ.items() if key != "MLFLOW_ALLOW_FILE_STORE"}
    result = subprocess.run([str(DEW), "train", str(tmp_path / "recipe.yaml")], capture_output=True,
                            text=True, timeout=600, cwd=tmp_path, env={**env, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "trackers.1.uri names it" in result.stderr
    assert "trackers.0.directory" not in result.stderr
