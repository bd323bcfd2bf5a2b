"""opd.utils.refusals: checks tried in order, the first problem found reported."""

from opd.utils.refusals import Finding, Refusal, first_problem

CHECKS = (
    Refusal(lambda n: n < 0, "negative"),
    Finding(lambda n: "odd" if n % 2 else None, lambda n, found: f"{n} is {found}"),
    lambda n: "too large" if n > 10 else None,
    Refusal(lambda n: n > 5, lambda n: f"{n} > 5"),
)


def test_the_first_problem_in_order_or_none() -> None:
    assert first_problem(CHECKS, -2) == "negative"
    assert first_problem(CHECKS, 3) == "3 is odd"
    assert first_problem(CHECKS, 12) == "too large"
    assert first_problem(CHECKS, 8) == "8 > 5"
    assert first_problem(CHECKS, 4) is None
