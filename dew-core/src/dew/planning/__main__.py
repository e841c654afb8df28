"""``python -m dew.planning '{"recipe": ..., "overrides": [...]}'``: the child ``dew plan`` starts.

It sees the target's devices (the parent sets XLA_FLAGS before JAX starts), plans the step and prints
one JSON line, ``{"plan": ...}`` or ``{"error": ...}``; the parent prints it. Exit status 0 for a
plan, 2 for an error dew names (the message says what to change), 1 for anything else.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> int:
    from dew.planning.plan import PlanRefusedError, make_plan
    from dew.recipes.config import RunConfig

    request = json.loads(argv[1])
    try:
        config = RunConfig.load(request["recipe"], overrides=request["overrides"])
        plan = make_plan(config, request["recipe"])
    except Exception as error:  # noqa: BLE001 - every failure is reported to the parent as one line
        named = type(error).__module__.split(".")[0] == "dew"
        if not named:
            traceback.print_exc()
        refused = isinstance(error, PlanRefusedError)
        kind = type(error.__cause__ if refused and error.__cause__ is not None else error).__name__
        print(json.dumps({"error": {"type": kind, "message": str(error), "leaves": error.leaves if isinstance(error, PlanRefusedError) else []}}))
        return 2 if named else 1
    print(json.dumps({"plan": plan.as_json()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
