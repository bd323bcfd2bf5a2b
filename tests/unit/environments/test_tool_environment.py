"""The tool environment: each tool failure mode becomes an observation the student sees, never a crash."""

from __future__ import annotations

import threading

import pytest

from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import Tool, ToolRegistry, argument_problem
from opd.rollout.tools.sandbox import SandboxLimits

ROW = {"messages": [{"role": "user", "content": "What is 1234 * 567?"}], "ground_truth": "699678"}
RELEASE = threading.Event()


def _failing(reason: str) -> str:
    raise RuntimeError(reason)


def _stuck() -> str:
    RELEASE.wait(30)  # released at the end of the test: the abandoned thread then ends
    return "late"


def _environment() -> ToolEnvironment:
    tools = ToolRegistry([calculator_tool()])
    tools.register("fail", _failing, {"type": "object", "properties": {"reason": {"type": "string"}}})
    tools.register("stuck", _stuck, {"type": "object", "properties": {}})
    tools.register("big", lambda: "x" * 500, {"type": "object", "properties": {}})
    tools.register("structured", lambda: {"total": 3}, {"type": "object", "properties": {}})
    return ToolEnvironment(tools, SandboxLimits(timeout_s=0.2, max_output_chars=100, isolation="thread"))


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _step(text: str, ended: bool = True, last_turn: bool = False):
    return _environment().start(ROW).step(StudentTurn(text, (), ended), last_turn=last_turn)


def test_successful_call_answers_with_a_tool_message():
    result = _step(_call("calculator", '{"expression": "1234 * 567"}'))
    assert not result.done
    assert result.observation == [{"role": "tool", "content": "699678"}]
    assert (result.tool_calls, result.well_formed_calls, result.successful_calls) == (1, 1, 1)


def test_structured_result_is_json():
    assert _step(_call("structured", "{}")).observation[0]["content"] == '{"total": 3}'


@pytest.mark.parametrize(
    ("text", "expected", "well_formed"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "Error: malformed tool call: the call is not valid JSON", 0),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {}}',
            "Error: malformed tool call: the call is not closed with </tool_call>",
            0,
        ),
        (_call("search", '{"q": "x"}'), "Error: there is no tool named 'search'", 1),
        (_call("calculator", "{}"), "Error: calculator: arguments: 'expression' is a required property", 1),
        (
            _call("calculator", '{"expression": 3}'),
            "Error: calculator: arguments['expression']: 3 is not of type 'string'",
            1,
        ),
        (
            _call("calculator", '{"expression": "1", "x": 1}'),
            "Error: calculator: arguments: Additional properties are not allowed ('x' was unexpected)",
            1,
        ),
        (_call("calculator", '{"expression": "os.system(1)"}'), "Error: calculator failed: CalculatorError", 1),
        (_call("fail", '{"reason": "disk full"}'), "Error: fail failed: RuntimeError: disk full", 1),
        (_call("stuck", "{}"), "Error: stuck did not finish within 0.2 s", 1),
    ],
)
def test_each_failure_is_an_error_observation(text, expected, well_formed):
    RELEASE.clear()
    try:
        result = _step(text)
    finally:
        RELEASE.set()
    assert not result.done, "a failed call is answered; the student may try again"
    (message,) = result.observation
    assert message["role"] == "tool"
    assert message["content"].startswith(expected), message["content"]
    assert (result.tool_calls, result.well_formed_calls, result.successful_calls) == (1, well_formed, 0)


def test_long_output_is_cut_and_says_so():
    (message,) = _step(_call("big", "{}")).observation
    assert message["content"].startswith("x" * 100 + "\n[output cut: 500 characters, the limit is 100]")


def test_every_call_of_a_turn_is_answered_in_order():
    text = _call("calculator", '{"expression": "2*3"}') + "\n<tool_call>oops</tool_call>" + _call("big", "{}")
    result = _step(text)
    assert [message["content"][:6] for message in result.observation] == ["6", "Error:", "xxxxxx"]
    assert (result.tool_calls, result.well_formed_calls, result.successful_calls) == (3, 2, 2)


def test_answer_ends_the_episode_with_the_verifier_reward():
    assert _step("The product is \\boxed{699678}.").reward == 1.0
    assert _step("The product is \\boxed{699679}.").reward == 0.0
    no_truth = _environment().start({"messages": []}).step(StudentTurn("\\boxed{1}", (), True))
    assert no_truth.done and no_truth.reward is None


def test_cut_turn_and_last_turn_end_without_running_tools():
    calls = []
    tools = ToolRegistry([Tool("spy", lambda: calls.append(1) or "ran", "", {"type": "object", "properties": {}})])
    episode = ToolEnvironment(tools).start(ROW)
    cut, last = StudentTurn(_call("spy", "{}"), (), ended=False), StudentTurn(_call("spy", "{}"), (), ended=True)
    for turn, last_turn in ((cut, False), (last, True)):
        result = episode.step(turn, last_turn=last_turn)
        assert result.done and result.reward == 0.0 and result.observation == []
    assert calls == []


def test_registry_refuses_bad_tools():
    tools = ToolRegistry([calculator_tool()])
    with pytest.raises(ValueError, match="registered already"):
        tools.add(calculator_tool())
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("t", print, "", {"type": "string"})
    with pytest.raises(ValueError, match="tool name"):
        Tool("bad name", print, "", {"type": "object", "properties": {}})


NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["m", "s"]},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}}},
    },
    "required": ["unit"],
}


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"unit": "m", "points": [{"x": 1.5}, {"x": 0}]}, None),
        ({"unit": "kg"}, "arguments['unit']: 'kg' is not one of ['m', 's']"),
        (
            {"unit": "m", "points": [{"x": 1}, {"x": -2}]},
            "arguments['points'][1]['x']: -2 is less than the minimum of 0",
        ),
        ({"unit": "m", "points": [{"x": True}]}, "arguments['points'][0]['x']: True is not of type 'number'"),
        # A value the model wrote at any length is quoted shortened: the observation names the rule, not the value.
        ({"unit": "m" * 10_000}, "arguments['unit']: 'mmmmmmmmmmmm...mmmmmmmmmmmmm' does not satisfy enum: ['m', 's']"),
    ],
)
def test_arguments_are_checked_against_the_whole_schema(arguments, expected):
    """Nested items, enums and bounds are checked before the tool runs (JSON schema draft 2020-12)."""
    tool = Tool("measure", lambda **kwargs: "ok", "", NESTED_SCHEMA)
    assert argument_problem(tool, arguments) == expected


def test_a_tool_with_an_invalid_schema_is_refused_at_registration():
    with pytest.raises(ValueError, match="tool 'measure': parameters is not a valid JSON schema"):
        Tool("measure", lambda **kwargs: "ok", "", {"type": "object", "properties": {"x": {"type": "strung"}}})
