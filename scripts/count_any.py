"""Count the loose typing in dew's source: `Any` annotations and `getattr` with a default.

Issue 30's measure: `Any` only where a value really is arbitrary, and a `getattr`
with a default only where an object really is foreign. Reads every module under
`dew-*/src` with `ast` and prints, per top-level folder of the `dew` package
(dew/training, dew/checkpoints, ...; modules directly in dew/ count as `dew`):

- `Any annotations`: annotations (parameters, returns, variables, attributes) whose
  whole expression is the bare name `Any` (or `typing.Any`);
- `Any names`: every occurrence of the name `Any` in an expression, including
  inside other types (`dict[str, Any]`) and aliases, not counting imports;
- `getattr default`: calls `getattr(obj, name, default)` with three arguments.

Run from the repository root: `python scripts/count_any.py` (add `--files` for a
per-file breakdown).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _is_any(node: ast.expr | None) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any" and isinstance(node.value, ast.Name) and node.value.id in {"typing", "t"}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip() in {"Any", "typing.Any"}
    return False


def _annotations(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    yield arg.annotation
            yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def _any_names(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "Any":
            count += 1
        elif isinstance(node, ast.Attribute) and node.attr == "Any":
            count += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # string annotations ("dict[str, Any]") written under quotes
            text = node.value
            if len(text) < 200 and "Any" in text:
                try:
                    inner = ast.parse(text, mode="eval")
                except SyntaxError:
                    continue
                count += sum(1 for n in ast.walk(inner) if isinstance(n, ast.Name) and n.id == "Any")
    return count


def _getattr_defaults(tree: ast.AST) -> int:
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 3
    )


def _folder(path: Path) -> str:
    parts = path.parts
    index = parts.index("dew")
    rest = parts[index + 1 :]
    return "dew" if len(rest) <= 1 else f"dew/{rest[0]}"


def count(root: Path = ROOT) -> dict[Path, Counter[str]]:
    """Per-file counts of the three measures over every `dew-*/src/dew/**/*.py`."""
    result: dict[Path, Counter[str]] = {}
    for path in sorted(root.glob("dew-*/src/dew/**/*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        counts: Counter[str] = Counter()
        counts["annotations"] = sum(1 for a in _annotations(tree) if _is_any(a))
        counts["names"] = _any_names(tree)
        counts["getattr"] = _getattr_defaults(tree)
        result[path.relative_to(root)] = counts
    return result


def main(argv: list[str]) -> int:
    per_file = count()
    per_folder: dict[str, Counter[str]] = {}
    for path, counts in per_file.items():
        per_folder.setdefault(_folder(path), Counter()).update(counts)
    total: Counter[str] = Counter()
    for counts in per_folder.values():
        total.update(counts)
    header = f"{'folder':<22}{'Any annotations':>17}{'Any names':>11}{'getattr default':>17}"
    print(header)
    print("-" * len(header))
    for folder, counts in sorted(per_folder.items(), key=lambda item: (-item[1]["annotations"], item[0])):
        print(f"{folder:<22}{counts['annotations']:>17}{counts['names']:>11}{counts['getattr']:>17}")
    print("-" * len(header))
    print(f"{'total':<22}{total['annotations']:>17}{total['names']:>11}{total['getattr']:>17}")
    if "--files" in argv:
        print()
        for path, counts in sorted(per_file.items(), key=lambda item: (-item[1]["annotations"], str(item[0]))):
            if any(counts.values()):
                print(f"{str(path):<70}{counts['annotations']:>5}{counts['names']:>5}{counts['getattr']:>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
