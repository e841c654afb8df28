"""run.json holds a shipped recipe without its secrets (the recipe names the objectives' and data's components)."""

from __future__ import annotations

import json

from dew.recipes.config import RunConfig


def test_run_json_holds_the_recipe_without_its_secrets(tmp_path):
    config = RunConfig.load("tiny-lm", overrides=[
        "data.files=https://reader:hunter2@data.example/corpus/*.py",
        f"trackers.0.directory={tmp_path}/journal",
    ])
    path = config.save(tmp_path / "ckpt")
    assert "hunter2" not in path.read_text()
    saved = json.loads(path.read_text())
    assert saved["data"]["files"] == "https://reader:***@data.example/corpus/*.py"
    assert saved["trackers"][0]["directory"] == f"{tmp_path}/journal"  # the rest is as given
    assert config.data.fields["files"].startswith("https://reader:hunter2@")  # built as given
