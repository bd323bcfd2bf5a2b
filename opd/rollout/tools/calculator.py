"""The built-in calculator tool: arithmetic parsed with :mod:`ast`, never evaluated as Python.

Only numbers, ``+ - * / // % **``, unary signs and parentheses are accepted and computed node by node, so a model
cannot reach a builtin, an import or an attribute. The expression's length, the exponent and every intermediate
integer are bounded before the work is done, so ``9**9**9`` is refused at once (a thread cannot be stopped, see
:mod:`opd.rollout.tools.sandbox`).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from opd.rollout.tools.registry import Tool

MAX_EXPRESSION_CHARS = 256
"""Longest expression accepted."""
MAX_EXPONENT = 128
"""Largest absolute exponent of ``**``."""
MAX_INTEGER_DIGITS = 100
"""Largest integer, in decimal digits, that any step may produce."""

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _check_size(value: int | float) -> int | float:
    if isinstance(value, complex):  # a fractional power of a negative number
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and abs(value).bit_length() > MAX_INTEGER_DIGITS * 3.33:
        raise CalculatorError(f"a number in the computation has more than {MAX_INTEGER_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _compute(node: ast.AST) -> int | float:
    """The value of an arithmetic syntax tree (refuses every other node)."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, found {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_compute(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _compute(node.left), _compute(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents are limited to {MAX_EXPONENT}, found {right}")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"the operator {type(node.op).__name__} is not arithmetic here (use + - * / // % **)")
    raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, found {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression``, as text (an integer stays exact).

    Raises:
        CalculatorError: for anything but arithmetic on numbers, a division by zero, or a
            value out of bounds; the message says which.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {error.msg}") from None
    value = _compute(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {
            "type": "string",
            "description": "an arithmetic expression, e.g. '1234 * 567'; numbers, + - * / // % ** and parentheses",
        }
    },
    "required": ["expression"],
    "additionalProperties": False,
}
"""The calculator's arguments, as the chat template shows them to the model."""


def calculator_tool(name: str = "calculator") -> Tool:
    """The calculator as a :class:`~opd.rollout.tools.registry.Tool` named ``name``."""
    # Bounded pure Python that cannot end its process: safe on a thread of the rollout's process.
    return Tool(name, calculate, "Evaluates an arithmetic expression exactly.", CALCULATOR_SCHEMA, thread_safe=True)
