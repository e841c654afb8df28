"""Which fields of a recipe name the path an error is about: a missing base run, teacher, export or
tokenizer is traced to the recipe field that asks for it, by ``dew train`` (fresh, resumed or
``--check``) and by the commands that rebuild a run from its run.json."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from dew.placeholders import expand

if TYPE_CHECKING:
    from dew.recipes.config import RunConfig

__all__ = ["absolute_in", "fields_naming"]


def absolute_in(path: str, cwd: Path) -> Path:
    """path made absolute from cwd, ``~`` expanded and ``..`` folded."""
    return Path(os.path.normpath(cwd / Path(path).expanduser()))


def fields_naming(config: RunConfig, error: Exception, *, cwd: Path, timestamp: str | None) -> list[tuple[str, Path]]:
    """The recipe's fields whose path (placeholders expanded, made absolute) the message names,
    with that path: a missing base run, teacher, export or tokenizer is then traced to where the
    recipe asks for it. cwd is where the recipe's relative paths start; timestamp (the run's, None
    before it has one) fills the {timestamp} placeholder."""
    from dew.tracking.background import TrackerWriteError
    from dew.tracking.rows import recipe_fields

    message = str(error)

    def expanded(value: str) -> str:
        return str(expand(value, timestamp)) if timestamp is not None else value

    # The run's own folder is no prerequisite: a field that names it (the local tracker's directory,
    # as every shipped recipe writes it) is not where an error about the run's folder comes from,
    # unless the tracker's own write failed there.
    own = config.trainer.checkpoint_dir
    run_folder = (absolute_in(expanded(own), cwd)
                  if isinstance(own, str) and own and not isinstance(error, TrackerWriteError) else None)
    found = []
    for key, value in recipe_fields(config.model_dump(mode="json")).items():
        if not isinstance(value, str) or not value or key.startswith("trainer.checkpoint_dir"):
            continue
        value = expanded(value)
        if "/" not in value and "." not in value:
            continue  # a name, not a path
        if "://" in value:  # an address (a tracker's uri): named as it is written
            if value in message:
                found.append((key, Path(value)))
            continue
        where = absolute_in(value, cwd)
        if where == run_folder:
            continue
        # The path, or a file under it, but not as the tail of a longer path or an address
        # (file:///runs/a/mlruns does not name the field holding /runs/a).
        named = re.search(r"(?<![\w/.:~-])" + re.escape(str(where)) + r"(?![\w.~-])", message)
        if named or (("/" in value) and f"'{value}'" in message):
            found.append((key, where))
    # Fields naming one path (a checkpoint that is also the tokenizer): a message that says which
    # field it is about ("init.pretrained ...") is traced to that one alone.
    return [(key, where) for key, where in found
            if key in message or not any(other in message for other, same in found if same == where)]
