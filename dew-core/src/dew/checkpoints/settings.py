"""Where a run's checkpoints go and how many are kept: the arguments of Checkpoints.

>>> CheckpointSettings(checkpoint_dir="runs/a", keep=2).checkpoint_arguments()
{'directory': 'runs/a', 'keep': 2}
>>> CheckpointSettings().checkpoint_arguments() is None
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pydantic
from pydantic import Field

from dew.placeholders import absolute, expand
from dew.settings import Settings

if TYPE_CHECKING:
    from dew.checkpoints.manager import Checkpoints

__all__ = ["CheckpointSettings"]


class CheckpointSettings(Settings):
    """A persistent checkpoint directory, its retention, and optional per-host local checkpoints."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    checkpoint_dir: str | None = Field(None, description="persistent checkpoint directory")
    keep: int | None = Field(3, ge=1, description="checkpoints kept; unset keeps all")
    local_checkpoint_dir: str | None = Field(
        None, description="a per-host directory for frequent local checkpoints"
    )
    local_every: int | None = Field(None, ge=1, description="steps between local checkpoints")

    @pydantic.field_validator("checkpoint_dir", "local_checkpoint_dir")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        # "" would make the working directory the run's folder. (Checked here, not by min_length,
        # which pydantic counts in Rust and so refuses a path of bytes that are no UTF-8 as no text.)
        if value == "":
            raise ValueError("an empty folder name would make the working directory the run's folder; "
                             "name a folder, or null for none")
        return value

    @pydantic.model_validator(mode="after")
    def _local_has_a_directory(self) -> CheckpointSettings:
        if self.local_every is not None and self.local_checkpoint_dir is None:
            raise ValueError("local_every needs local_checkpoint_dir")
        return self

    def build_checkpoints(self, timestamp: str = "") -> Checkpoints | None:
        """The Checkpoints these settings describe, or None when no checkpoint_dir is named.

        Placeholders in the directories are replaced (``{timestamp}``: see
        dew.placeholders) and local paths made absolute; a URL stays as given.
        """
        if self.checkpoint_dir is None:
            return None
        from dew.checkpoints.manager import Checkpoints

        local = self.local_checkpoint_dir
        return Checkpoints(
            absolute(expand(self.checkpoint_dir, timestamp)), keep=self.keep,
            local_directory=None if local is None else absolute(expand(local, timestamp)),
            local_every=self.local_every if local is not None else None,
        )

    def checkpoint_arguments(self) -> dict[str, object] | None:
        """Checkpoints' keywords, or None when no checkpoint directory is named."""
        if self.checkpoint_dir is None:
            return None
        arguments: dict[str, object] = {"directory": self.checkpoint_dir, "keep": self.keep}
        if self.local_checkpoint_dir is not None:
            arguments["local_directory"] = self.local_checkpoint_dir
            arguments["local_every"] = self.local_every
        return arguments
