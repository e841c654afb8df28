"""Know a run before it runs: ``dew plan`` compiles a recipe's training step for a target mesh on
fake CPU devices and reports, per device, the bytes, collectives and FLOPs of one step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dew._surface import surface

if TYPE_CHECKING:
    from dew.planning.plan import Plan as Plan
    from dew.planning.plan import PlanRefusedError as PlanRefusedError
    from dew.planning.plan import make_plan as make_plan
    from dew.planning.remat import Rematerialization as Rematerialization

__getattr__, __dir__, __all__ = surface(__name__, __file__)
