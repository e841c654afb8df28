"""Taking secrets out of what a run records about itself.

A recipe is written down several times (``run.json``, the RunStarted record
in every tracker's journal, a tracker's parameters), and whatever a recipe
holds travels with those copies: a password inside a tracking URI, a token in
a tracker's field. ``redact`` returns a copy of a recorded tree in which
credentials in URIs (``scheme://user:password@host``), secret-named query
parameters (``?token=...``) and fields named like secrets (``password``,
``api_key``, ``access_token``, ``client_secret``, ...) are replaced by
``REDACTED``. The components themselves are built from the recipe as given,
so a tracker still connects with the password; only the records lose it.
The better habit is to keep secrets out of recipes altogether: MLflow reads
``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` and W&B reads
``WANDB_API_KEY`` from the environment.

>>> redact({"uri": "http://ann:hunter2@mlflow.local:5000/x", "tokenizer": "byte",
...         "api_key": "abc", "text_key": "text"})
{'uri': 'http://ann:***@mlflow.local:5000/x', 'tokenizer': 'byte', 'api_key': '***', 'text_key': 'text'}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_redacted", "is_secret_field", "redact", "redact_text"]

REDACTED = "***"

# user:password@ after a URI scheme: the user ends at the first colon (an e-mail address as the user
# keeps its @), the password at the last @ before the host, as urllib.parse reads them.
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^/?#:\s]*):(?P<secret>[^/?#\s]*)@")
_QUERY = re.compile(
    r"(?P<head>[?&;](?:[^=&#\s]*?)(?:token|password|passwd|secret|api[_-]?key|apikey|signature|sig)"
    r"(?:[^=&#\s]*)=)(?P<secret>[^&#\s]*)",
    re.IGNORECASE,
)
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_SECRET_WORDS = {"password", "passwords", "passwd", "pwd", "secret", "secrets", "credential", "credentials",
                 "apikey", "passphrase"}
# A field ending in "token" or "key" is secret only after one of these ("text_key",
# "eos_token" and "max_tokens" are not).
_TOKEN_PREFIXES = {"access", "auth", "api", "bearer", "refresh", "session", "hf", "github", "gh",
                   "wandb", "mlflow", "personal", "id", "client", "private", "secret"}
_KEY_PREFIXES = {"api", "access", "secret", "private", "account", "signing", "encryption", "client"}


def is_secret_field(name: str) -> bool:
    """Whether a field of this name holds a secret (``password``, ``api_key``, ``hf_token``)."""
    words = [w.lower() for w in _WORDS.findall(name)]
    if not words:
        return False
    if _SECRET_WORDS.intersection(words):
        return True
    last, before = words[-1], words[-2] if len(words) > 1 else None
    if last == "token":
        return before is None or before in _TOKEN_PREFIXES
    if last == "key":
        return before in _KEY_PREFIXES
    return False


def redact_text(text: str) -> str:
    """text with URI passwords and secret query values replaced by REDACTED."""
    text = _USERINFO.sub(lambda m: f"{m['head']}:{REDACTED}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{REDACTED}", text)


def is_redacted(text: str) -> bool:
    """Whether text is, or holds in a URI's password or secret query value, what redact wrote:
    a prompt that merely contains ``***`` is not."""
    return text == REDACTED or any(match["secret"] == REDACTED
                                   for pattern in (_USERINFO, _QUERY) for match in pattern.finditer(text))


def redact(value: Any) -> Any:
    """A copy of a JSON-like tree with every secret it holds replaced by REDACTED."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            key: (REDACTED if isinstance(key, str) and is_secret_field(key)
                  and item not in (None, "") else redact(item))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact(item) for item in value)
    return value
