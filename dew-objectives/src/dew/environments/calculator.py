"""A calculator tool for the addition problems: the model calls it, reads its result, then answers.

An episode of ``a+b=`` (the addition dataset's prompts form) reads::

    7+8=calc(7+8=15       the opening "calc(" (open_call), the model's call "7+8=", the tool's "15"
    7+8=15                the question again, the model's answer; exact match against the record

The model calls the tool by writing ``calc(EXPR)`` (or, after the opening
``calc(``, ``EXPR)``; ``=`` closes a call too, as the addition model ends
an expression); the tool answers with the value of EXPR (integers with
``+``, ``-``, ``*`` and parentheses, or ``error``), a newline and the
question again, so the model's next turn is its answer. A turn that is not
a call is the answer: the episode ends with 1 when it equals the record's
``key`` value (``dew.rewards.ExactMatch``), else 0. With open_call the
opening starts the call, so a model that never saw the tool still writes one
(the addition model writes an expression and closes it with ``=``); which
expression it writes, and whether it reads the result, is left to the reward.
"""

from __future__ import annotations

import ast
import operator
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dew.environments import Reply
from dew.errors import BatchKeyError
from dew.rewards import ExactMatch

__all__ = ["Calculator", "CalculatorEpisode", "arithmetic"]

_CALL = re.compile(r"(?:calc\()?([^()=\n]*(?:\([^()=\n]*\)[^()=\n]*)*)[)=]\s*$")
_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
# ast.parse on several threads at once raised "SystemError: AST constructor recursion depth mismatch"
# (a shared counter in CPython 3.11's AST conversion), which ended those episodes with reward 0.
_PARSING = threading.Lock()


def arithmetic(expression: str) -> int:
    """The value of an integer expression of +, -, * and parentheses; ValueError for anything else.

    >>> arithmetic("12+30"), arithmetic("(2+3)*4-1")
    (42, 19)
    """
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
            return _OPERATIONS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression of +, -, *: {expression!r}")

    if len(expression) > 64:
        raise ValueError(f"expression longer than 64 characters: {expression[:64]!r}...")
    try:
        with _PARSING:  # episodes step on threads, and CPython 3.11's AST conversion is not thread-safe
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    return value(tree.body)


@dataclass(eq=False)
class CalculatorEpisode:
    """One problem: the calls made so far, and the record's answer."""

    environment: Calculator
    prompt: str
    record: Mapping[str, Any]
    calls: int = 0
    turns: list[str] = field(default_factory=list)

    def opening(self) -> str:
        return "calc(" if self.environment.open_call else ""

    def step(self, action: str) -> Reply:
        self.turns.append(action)
        opened = self.environment.open_call and self.calls == 0
        call = _CALL.fullmatch(action.strip()) if opened or action.lstrip().startswith("calc(") else None
        if call is not None and self.calls < self.environment.max_calls:
            self.calls += 1
            try:
                result = str(arithmetic(call.group(1)))
            except ValueError:
                result = "error"
            return Reply(f"{result}\n{self.prompt}")
        key = self.environment.key
        right = ExactMatch(key=key)([action], {key: [self.record[key]]})
        return Reply(done=True, reward=float(right[0]))


@dataclass(frozen=True)
class Calculator:
    """Addition problems with a calculator tool (see the module docstring); registered as ``calculator``.

    key names the record's answer; open_call starts every episode inside a call;
    max_calls bounds the calls per episode (a further call counts as the answer).
    """

    key: str = "answer"
    open_call: bool = True
    max_calls: int = 1
    max_turns: int = 2
    stop_strings: tuple[str, ...] = (")", "=")

    def start(self, prompt: str, record: Mapping[str, Any]) -> CalculatorEpisode:
        if self.key not in record:
            raise BatchKeyError(f"The calculator checks answers under {self.key!r}, but the record holds "
                           f"{sorted(record)}; set Calculator(key=...) to the key holding the answers (in a "
                                "recipe, objective.environment.key).")
        return CalculatorEpisode(self, prompt, record)
