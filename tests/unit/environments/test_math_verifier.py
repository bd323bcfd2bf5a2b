"""Answer extraction and checking for validation accuracy."""

import pytest

from opd.rollout.environments.math_verifier import extract_answer, is_correct


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so 3 + 4 = 7. The answer is \\boxed{7}.", "7"),
        ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last box, nested braces
        ("<think>x</think> <answer> 42 </answer>", "42"),
        ("<answer>wrong</answer> ... <answer>\\boxed{9}</answer>", "9"),
        ("no answer here", None),
        ("cut off \\boxed{12", None),  # unbalanced: the response was truncated inside the box
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    ("response", "truth", "correct"),
    [
        ("\\boxed{122}", "122", True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("<answer>1/2</answer>", "0.5", True),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
        ("\\boxed{2\\pi}", "2\\pi", True),
        ("<answer>x = 5</answer>", "5", True),
        ("\\boxed{(1, 2)}", "(1,2)", True),
        ("\\boxed{7}", "-7", False),
        ("\\boxed{121}", "122", False),
        ("\\boxed{}", "0", False),
        ("nothing", "3", False),
    ],
)
def test_is_correct(response, truth, correct):
    assert is_correct(response, truth) is correct
