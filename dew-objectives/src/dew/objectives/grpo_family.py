"""The GRPO family by name: each paper's settings of the one ``GRPOObjective``.

Every class here is ``GRPOObjective`` with its paper's defaults, registered
under its own name in ``dew.objectives``; any field can still be set. The
formulas live in ``group_losses.py`` and the host-side filters in
``group_sampling.py``; ``docs/preference-and-rl.md`` lists each with its paper.

- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
  advantages not divided by the group's std, each completion's token sum
  divided by the constant generation budget, no KL term.
- ``dapo`` (Yu et al. 2025): clip-higher (0.2 below, 0.28 above), token-level
  aggregation, dynamic sampling, the soft overlong penalty, no KL term.
- ``gspo`` (Zheng et al. 2025): one length-normalized ratio per sequence,
  clipped per sequence (3e-4 below, 4e-4 above), averaged over sequences;
  ``ratio="sequence_token"`` is GSPO-token.
- ``rloo`` (Ahmadian et al. 2024): the leave-one-out baseline, unscaled, and
  each completion's summed log-probability (a length normalizer of 1).
- ``cispo`` (MiniMax 2025, MiniMax-M1): every token's gradient kept, weighted
  by its stop-gradient importance ratio clipped to at most 1.28, token-level.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Literal

from dew.objectives.group_losses import Aggregation, Baseline, PolicyLoss, RatioLevel
from dew.objectives.group_sampling import IncompatibleOptionsError
from dew.objectives.grpo import GRPOObjective

__all__ = ["CISPOObjective", "DAPOObjective", "DrGRPOObjective", "GSPOObjective", "RLOOObjective"]


@dataclass(frozen=True)
class DrGRPOObjective(GRPOObjective):
    """Dr.GRPO: GRPO without the std division and with a constant length normalizer."""

    _: KW_ONLY
    beta: float = 0.0
    scale_rewards: bool = False
    normalize: Aggregation = "constant"


@dataclass(frozen=True)
class DAPOObjective(GRPOObjective):
    """DAPO: clip-higher, token-level loss, dynamic sampling and overlong shaping (needs stop_token)."""

    _: KW_ONLY
    beta: float = 0.0
    clip_low: float | None = 0.2
    clip_high: float | None = 0.28
    normalize: Aggregation = "token"
    dynamic_sampling: bool = True
    overlong: Literal["none", "penalty", "mask"] = "penalty"


@dataclass(frozen=True)
class GSPOObjective(GRPOObjective):
    """GSPO: the sequence's length-normalized importance ratio, clipped per sequence."""

    _: KW_ONLY
    beta: float = 0.0
    ratio: RatioLevel = "sequence"
    clip_low: float | None = 3e-4
    clip_high: float | None = 4e-4
    normalize: Aggregation = "sequence"

    def __post_init__(self) -> None:
        if self.ratio == "token":
            raise IncompatibleOptionsError(
                "GSPOObjective.ratio='token' is token-level clipping, which GSPO replaces: it clips "
                "one length-normalized ratio per sequence. Use ratio='sequence' (GSPO) or "
                "'sequence_token' (GSPO-token), or the grpo objective for token-level ratios."
            )
        super().__post_init__()


@dataclass(frozen=True)
class RLOOObjective(GRPOObjective):
    """RLOO: each completion's reward less the mean of its group's others, on its summed log-probability.

    The KL to the reference is the family's (beta times the per-token k3 estimate, in the loss), not the
    paper's reward shaping (beta times the summed log-ratio subtracted from the reward): the two agree
    at beta=0 (docs/preference-and-rl.md, "Beside TRL").
    """

    _: KW_ONLY
    baseline: Baseline = "leave_one_out"
    scale_rewards: bool = False
    normalize: Aggregation = "constant"
    length_normalizer: float | None = 1.0


@dataclass(frozen=True)
class CISPOObjective(GRPOObjective):
    """CISPO: REINFORCE on every token, weighted by the clipped, stop-gradient importance ratio."""

    _: KW_ONLY
    beta: float = 0.0
    policy_loss: PolicyLoss = "cispo"
    clip_low: float | None = 1.0
    clip_high: float | None = 0.28
    normalize: Aggregation = "token"
