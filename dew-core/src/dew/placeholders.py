"""The placeholders a recipe's strings may hold, and where a recipe's local paths resolve.

A recipe's component fields, data.load and checkpoint directories may hold
three placeholders, replaced when the run is built (run.json keeps them as
written): ``{stdlib}``, the folder of Python's standard library (a corpus
every machine has); ``{recipes}``, the folder of the recipes dew ships (data
beside them); and ``{timestamp}``, process 0's clock when the run started
(``run_timestamp``), the same on every process, written without colons
(``2026-12-01_09-30-00``) so a folder named after it is valid on every file
system and in a URL. A string that starts with ``~/`` starts in the home
folder, as a shell reads it. Importing this module imports nothing of dew's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["PLACEHOLDERS", "absolute", "expand", "unknown_placeholder"]

PLACEHOLDERS = ("timestamp", "stdlib", "recipes")


def expand(value: Any, timestamp: str) -> Any:
    """value with {stdlib}, {recipes} and {timestamp} replaced in every string it holds, and a
    leading ``~/`` made the home folder (every path field of a recipe then reads it as a shell does).

    The timestamp's colons become dashes, so it can name a folder anywhere:

    >>> expand({"directory": "runs/{timestamp}"}, "2026-12-01_09:30:00")
    {'directory': 'runs/2026-12-01_09-30-00'}
    >>> expand("~/corpus.txt", "") == os.path.join(os.path.expanduser("~"), "corpus.txt")
    True
    """
    if isinstance(value, str):
        if value == "~" or value.startswith("~/"):  # a path in the home folder, as a shell reads it
            value = os.path.expanduser(value)
        if "{recipes}" in value:  # data shipped beside the recipes (a fine-tuning set, say)
            value = value.replace("{recipes}", str(Path(__file__).resolve().parent / "recipes"))
        if "{stdlib}" in value:
            import sysconfig

            value = value.replace("{stdlib}", sysconfig.get_paths()["stdlib"])
        return value.replace("{timestamp}", timestamp.replace(":", "-"))
    if isinstance(value, dict):
        return {k: expand(v, timestamp) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(expand(v, timestamp) for v in value)
    return value


def absolute(path: str) -> str:
    """A local path made absolute; a URL (gs://bucket/run, s3://...) passes through unchanged.

    >>> absolute("gs://bucket/run")
    'gs://bucket/run'
    """
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def unknown_placeholder(path: str) -> str | None:
    """What is wrong with a braced word in a path that is no placeholder (a misspelt ``{timestmap}``,
    a shell's ``${timestamp}``) or an environment variable (``$HOME``): left as written, it would name
    a folder; None when all are known.

    >>> unknown_placeholder("runs/{timestmap}").split(":")[0]
    '{timestmap} is no placeholder'
    >>> unknown_placeholder("runs/{timestamp}") is None
    True
    >>> unknown_placeholder("$HOME/runs").split(",")[0]
    '$HOME is an environment variable'
    """
    import re

    for found in re.finditer(r"(\$?)\{([^{}/]*)\}", path):
        shell, word = found.groups()
        if word not in PLACEHOLDERS:
            return (f"{{{word}}} is no placeholder: dew replaces {{timestamp}}, {{stdlib}} and {{recipes}}, and "
                    "would leave it in the path as written")
        if shell:
            return f"${{{word}}} is a shell's form: dew replaces {{{word}}} and would leave the $ in the path"
    variable = re.search(r"\$[A-Za-z_][A-Za-z0-9_]*", path)
    if variable is not None:
        return (f"{variable.group()} is an environment variable, which dew does not expand (it would name a "
                f"folder {variable.group()!r}): write the path out, or leave an override unquoted for the shell "
                "to expand it")
    return None
