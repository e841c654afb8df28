"""Secrets are redacted from what a run records, and only secrets."""

from __future__ import annotations

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




def test_a_user_name_holding_an_at_sign_keeps_its_password_redacted():
    """urllib.parse reads ann@corp.com as the user of http://ann@corp.com:hunter2@host and hunter2 as its
    password; the redaction's user part stopped at the first @ and left the password in run.json."""
    from urllib.parse import urlsplit

    uri = "http://ann@corp.com:hunter2@mlflow.local:5000/x"
    assert urlsplit(uri).password == "hunter2"
    assert redact_text(uri) == "http://ann@corp.com:***@mlflow.local:5000/x"
    assert redact_text("http://user@host:5000/path") == "http://user@host:5000/path"  # a port is no password
