"""Measure how the house is built: probed seams, the engine's size, and a batch's path.

Static figures (no JAX needed), over the source of the four distributions:

- ``getattr`` calls with a default (three arguments) and ``hasattr`` calls;
- ``Any``: every use of the name in code (imports not counted);
- files and lines under ``dew/training/`` (the engine with its runtime and placement
  wings), and the largest module of the source.

Dynamic figures (``--walk``): a tiny fit runs under ``sys.setprofile`` and every
call or return between two different dew modules that carries the batch (a
mapping with the batch's keys, or a value holding one) or the step's metrics (a
mapping with a ``loss`` key, or a value holding one) is recorded. A crossing is
one distinct edge (caller function -> callee function, or the way back), so the
count does not grow with the number of steps; every thread is traced (a tracker's
writer thread included). The batch is walked from the
reader (a ``dew.data.stream`` record stream) to the compiled step; the metrics
from the step to the tracker (``LocalTracker``).

    python scripts/measure_seams.py           # the static figures
    python scripts/measure_seams.py --walk    # and the walks (a few seconds of JAX)
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("dew-*/src"))


def _files() -> list[Path]:
    return sorted(p for source in SOURCES for p in source.rglob("*.py"))


def static() -> dict[str, object]:
    getattr_default = hasattr_calls = any_uses = 0
    largest = (0, "")
    for path in _files():
        text = path.read_text()
        lines = text.count("\n")
        largest = max(largest, (lines, str(path.relative_to(ROOT))))
        tree = ast.parse(text)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                imported.update(id(alias) for alias in node.names)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "getattr" and len(node.args) == 3:
                    getattr_default += 1
                if node.func.id == "hasattr":
                    hasattr_calls += 1
            if isinstance(node, ast.Name) and node.id == "Any":
                any_uses += 1
            if isinstance(node, ast.Attribute) and node.attr == "Any":
                any_uses += 1
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.strip() == "Any":
                any_uses += 1  # a quoted annotation
    training = ROOT / "dew-core/src/dew/training"
    engine = sorted(training.rglob("*.py"))
    flat = sorted(training.glob("*.py"))
    return {
        "getattr with a default": getattr_default,
        "hasattr": hasattr_calls,
        "Any": any_uses,
        "training/ files (with runtime/, placement/)": len(engine),
        "training/ lines (with runtime/, placement/)": sum(p.read_text().count("\n") for p in engine),
        "training/ top-level files": len(flat),
        "training/ top-level lines": sum(p.read_text().count("\n") for p in flat),
        "largest module": f"{largest[1]} ({largest[0]} lines)",
    }


# -- the walks ----------------------------------------------------------------------------------


def _holds(value: object, test, depth: int = 0) -> bool:
    """Whether value is, or directly holds (a field, an item), a value test accepts."""
    if test(value):
        return True
    if depth >= 2:
        return False
    if isinstance(value, tuple | list):
        return any(_holds(v, test, depth + 1) for v in value[:8])
    fields = getattr(type(value), "__dataclass_fields__", None)  # a foreign value: any dataclass
    if fields and not isinstance(value, type):
        return any(_holds(getattr(value, name, None), test, depth + 1) for name in fields)
    return False


def _is_batch(value: object) -> bool:
    return isinstance(value, Mapping) and {"x", "y"} <= set(value)


def _is_metrics(value: object) -> bool:
    return isinstance(value, Mapping) and bool({"loss", "train/loss"} & set(value))


def walk() -> dict[str, str]:
    import tempfile
    import threading

    import jax
    import numpy as np
    import optax

    from dew.data.sources import ArrayRecords
    from dew.data.stream import record_dataset
    from dew.testing.doubles import Regression, regression_batch
    from dew.training import LocalTracker, Trainer

    records = regression_batch(0, rows=64)
    dataset = record_dataset(ArrayRecords({k: np.asarray(v) for k, v in records.items()}), None,
                             batch=8, prefetch=0)
    edges: dict[str, set[tuple[str, str, str]]] = {"batch": set(), "metrics": set()}

    def module(frame) -> str:
        return frame.f_globals.get("__name__", "")

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        caller = frame.f_back
        if caller is None:
            return
        inner, outer = module(frame), module(caller)
        if inner == outer or not (inner.startswith("dew") and outer.startswith("dew")):
            return
        if event == "call":
            code = frame.f_code
            values = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        else:
            values = [arg]
        where = (f"{outer}.{caller.f_code.co_name}", f"{inner}.{frame.f_code.co_name}", event)
        for name, test in (("batch", _is_batch), ("metrics", _is_metrics)):
            if any(_holds(v, test) for v in values):
                edges[name].add(where)

    with tempfile.TemporaryDirectory() as directory:
        tracker = LocalTracker(directory)
        trainer = Trainer(Regression(), optax.sgd(0.01), key=jax.random.key(0), tracker=tracker)
        threading.setprofile(profile)  # a tracker's writer thread, when it has one
        sys.setprofile(profile)
        try:
            trainer.fit(dataset, steps=4, log_every=2)
            tracker.close()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    out = {}
    for name, found in edges.items():
        returns = sum(1 for *_, event in found if event == "return")
        out[f"{name} crossings (returns)"] = f"{len(found)} ({returns})"
        for outer, inner, event in sorted(found):
            arrow = "->" if event == "call" else "<-"
            out[f"  {name}: {outer} {arrow} {inner}"] = ""
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walk", action="store_true", help="also walk a batch through a tiny fit")
    args = parser.parse_args()
    figures: dict[str, object] = dict(static())
    if args.walk:
        figures.update(walk())
    for name, value in figures.items():
        print(f"{name}: {value}" if value != "" else name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
