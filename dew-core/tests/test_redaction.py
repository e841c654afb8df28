"""Secrets are redacted from what a run records, and only secrets."""

from __future__ import annotations

import json

from dew.recipes.config import RunConfig
from dew.telemetry.redaction import REDACTED, is_secret_field, redact, redact_text


def test_secret_fields_are_told_from_ordinary_ones():
    secret = ["password", "api_key", "apiKey", "hf_token", "token", "auth_token", "client_secret",
              "aws_secret_access_key", "accessToken", "mlflow_tracking_password"]
    ordinary = ["tokenizer", "eos_token", "pad_token_id", "max_tokens", "text_key", "label_key",
                "key", "monkey", "tokens_per_step", "name", "uri"]
    assert [n for n in secret if not is_secret_field(n)] == []
    assert [n for n in ordinary if is_secret_field(n)] == []


def test_uri_credentials_and_secret_query_values_are_redacted():
    text = ("http://ann:p@ss:w0rd@mlflow.local:5000/x?run=1&access_token=abc "
            "postgresql://u:pw@db/x sqlite:///a:b@c http://onlyuser@host/")
    assert redact_text(text) == (
        "http://ann:***@mlflow.local:5000/x?run=1&access_token=*** "
        "postgresql://u:***@db/x sqlite:///a:b@c http://onlyuser@host/"
    )
    tree = {"trackers": [{"name": "x", "api_key": "k", "token": None}], "n": 3, "flag": True}
    assert redact(tree) == {"trackers": [{"name": "x", "api_key": REDACTED, "token": None}],
                            "n": 3, "flag": True}


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
