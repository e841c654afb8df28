"""Where a run's checkpoints go and how many are kept: the arguments of Checkpoints.

>>> CheckpointSettings(checkpoint_dir="runs/a", keep=2).checkpoint_arguments()
{'directory': 'runs/a', 'keep': 2}
>>> CheckpointSettings().checkpoint_arguments() is None
True
"""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import Field

__all__ = ["CheckpointSettings"]


class CheckpointSettings(pydantic.BaseModel):
    """A persistent checkpoint directory, its retention, and optional per-host local checkpoints."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    checkpoint_dir: str | None = Field(None, description="persistent checkpoint directory")
    keep: int | None = Field(3, ge=1, description="checkpoints kept; unset keeps all")
    local_checkpoint_dir: str | None = Field(
        None, description="a per-host directory for frequent local checkpoints"
    )
    local_every: int | None = Field(None, ge=1, description="steps between local checkpoints")

    @pydantic.model_validator(mode="after")
    def _local_has_a_directory(self) -> CheckpointSettings:
        if self.local_every is not None and self.local_checkpoint_dir is None:
            raise ValueError("local_every needs local_checkpoint_dir")
        return self

    def checkpoint_arguments(self) -> dict[str, Any] | None:
        """Checkpoints' keywords, or None when no checkpoint directory is named."""
        if self.checkpoint_dir is None:
            return None
        arguments: dict[str, Any] = {"directory": self.checkpoint_dir, "keep": self.keep}
        if self.local_checkpoint_dir is not None:
            arguments["local_directory"] = self.local_checkpoint_dir
            arguments["local_every"] = self.local_every
        return arguments
