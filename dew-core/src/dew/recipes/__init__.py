"""Recipes: a whole run described in one validated YAML file, and the ones dew ships.

``RunConfig.load("tiny-lm", overrides=["trainer.steps=10"]).train()`` is what
``dew train tiny-lm trainer.steps=10`` runs. Names are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.recipes.config import RunConfig as RunConfig
    from dew.recipes.config import apply_overrides as apply_overrides
    from dew.recipes.config import recipe_path as recipe_path
    from dew.recipes.config import shipped as shipped
    from dew.recipes.errors import RecipeError as RecipeError

__getattr__, __dir__, __all__ = surface(__name__, __file__)
