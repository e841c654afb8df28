"""Objectives: what a run learns. The protocol lives in dew.objectives.base;
each kind of training (lm, diffusion, ...) is a module of dew-objectives."""

__path__ = __import__("pkgutil").extend_path(__path__, __name__)  # noqa: F821
