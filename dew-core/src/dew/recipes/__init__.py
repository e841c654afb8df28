"""Recipes: a whole run described in one validated YAML file, and the ones dew ships.

``RunConfig.load("tiny-lm", overrides=["trainer.steps=10"]).train()`` is what
``dew train tiny-lm trainer.steps=10`` runs. Names resolve on first use.
"""

from dew._lazy import Export, exporter

_CONFIG = "dew.recipes.config"
_EXPORTS = {
    "RunConfig": Export(_CONFIG),
    "RecipeError": Export("dew.recipes.errors"),
    "apply_overrides": Export(_CONFIG),
    "recipe_path": Export(_CONFIG),
    "shipped": Export(_CONFIG),
}

__getattr__, __dir__ = exporter(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
