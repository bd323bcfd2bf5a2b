"""The calculator computes arithmetic exactly and refuses everything else, without ever calling eval."""

from __future__ import annotations

import builtins

import pytest

from opd.rollout.tools.calculator import CalculatorError, calculate, calculator_tool


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1234 * 567", "699678"),
        ("(2 + 3) * -4", "-20"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("7 // 2 + 7 % 2", "4"),
        ("2 ** 10", "1024"),
        ("123456789 * 987654321", "121932631112635269"),  # exact beyond float precision
    ],
)
def test_computes_arithmetic(expression, value, monkeypatch):
    # eval and compile's "eval" path are never used: replacing eval with a trap changes nothing.
    def trap(*args, **kwargs):
        raise AssertionError("the calculator called eval")

    monkeypatch.setattr(builtins, "eval", trap)
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "Call"),
        ("open('/etc/passwd')", "Call"),
        ("x + 1", "Name"),
        ("(1).__class__", "Attribute"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 < 2", "Compare"),
        ("[1, 2]", "List"),
        ("lambda: 1", "Lambda"),
        ("1 ^ 2", "BitXor"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponents are limited"),
        ("10 ** 100 * 10 ** 100", "digits"),
        ("1e308 * 10", "finite"),
        ("1" * 300, "longer than"),
    ],
)
def test_refuses_anything_but_bounded_arithmetic(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        calculate(expression)


def test_tool_schema_lists_the_expression():
    schema = calculator_tool().schema()
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
