"""Diffusion written once: schedules, targets and weightings, samplers, guidance.

Every process is x_t = alpha(t) x0 + sigma(t) eps; the objectives in
``dew.objectives.diffusion`` and the pipelines build on these pieces. Nothing
here knows about a model's architecture or the trainer.
"""

from dew.diffusion.guidance import drop_condition, guide
from dew.diffusion.process import Diffusion, Model, Noisy
from dew.diffusion.samplers import METHODS, Denoiser, Method, grid, ode_space, sample
from dew.diffusion.schedules import (
    EDM,
    SCHEDULES,
    RectifiedFlow,
    Schedule,
    VPCosine,
    VPLinear,
    karras_sigmas,
    noise_schedule,
    schedule_named,
)
from dew.diffusion.targets import (
    TARGETS,
    WEIGHTINGS,
    Target,
    Weighting,
    loss_weight,
    target_of,
    to_x0_eps,
)

__all__ = [
    "EDM",
    "METHODS",
    "SCHEDULES",
    "TARGETS",
    "WEIGHTINGS",
    "Denoiser",
    "Diffusion",
    "Method",
    "Model",
    "Noisy",
    "RectifiedFlow",
    "Schedule",
    "Target",
    "VPCosine",
    "VPLinear",
    "Weighting",
    "drop_condition",
    "grid",
    "guide",
    "karras_sigmas",
    "loss_weight",
    "ode_space",
    "noise_schedule",
    "sample",
    "schedule_named",
    "target_of",
    "to_x0_eps",
]
