"""Tools and environments declared in the config: importable callables, schemas from type hints, graders, members.

The schema derived from a signature is compared with the one written by hand; bad declarations are refused when
the config is read, naming the key.
"""

from __future__ import annotations

import pytest
from opd_config_tools import describe, multiply

from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.config import EnvironmentConfig, build_environment
from opd.rollout.environments.routed_environment import ROUTE_FIELD, RoutedEnvironment
from opd.rollout.tools.sandbox import SandboxLimits, run_tool
from opd.rollout.tools.specs import ToolSpec, schema_from_signature
from opd.utils.errors import DataError


def _call(name: str, arguments: str) -> StudentTurn:
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    return StudentTurn(text, (1, 2), ended=True)


def test_the_schema_of_a_signature_has_its_types_defaults_and_docstring():
    assert schema_from_signature(multiply) == {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "a": {"type": "integer", "description": "the first factor"},
            "b": {"type": "integer", "description": "the second factor, an integer too"},
        },
        "required": ["a", "b"],
    }
    schema = schema_from_signature(describe)
    # An argument called "title" is an argument, not pydantic's title annotation.
    assert schema["properties"]["title"] == {"type": "string"}
    assert schema["properties"]["tags"] == {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
        "default": None,
    }
    assert schema["properties"]["loud"] == {"type": "boolean", "default": False}
    assert schema["required"] == ["title"]


def test_a_declared_tool_is_built_with_its_name_description_and_schema():
    config = EnvironmentConfig.model_validate(
        {
            "tools": [
                "calculator",
                {"function": "opd_config_tools:multiply"},
                {"function": "opd_config_tools:describe", "name": "label", "thread_safe": True},
            ]
        }
    )
    registry = config.registry()
    multiply_tool, label = registry.get("multiply"), registry.get("label")
    assert multiply_tool is not None and label is not None
    assert multiply_tool.description == "Multiplies two integers."
    assert multiply_tool.parameters == schema_from_signature(multiply)
    assert label.thread_safe and not multiply_tool.thread_safe
    limits = SandboxLimits(timeout_s=10.0)
    assert run_tool(multiply_tool, "multiply", {"a": 6, "b": 7}, limits).content == "42"
    refused = run_tool(multiply_tool, "multiply", {"a": 6, "b": "7"}, limits)
    assert not refused.ok and "arguments['b']" in refused.content
    assert run_tool(label, "label", {"title": "x", "loud": True}, limits).content == "X []"


def test_given_parameters_replace_the_derived_schema():
    parameters = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"type": "integer"}}}
    spec = ToolSpec(function="opd_config_tools:multiply", parameters=parameters, description="times")
    tool = spec.build("environment.tools[0]")
    assert tool.parameters == parameters and tool.description == "times"
    limits = SandboxLimits(timeout_s=10.0, isolation="thread")
    assert "maximum" in run_tool(tool, "multiply", {"a": 10, "b": 1}, limits).content


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{"function": "opd_config_tools"}], "must be 'package.module:attribute'"),
        ([{"function": "no_such_module_x:f"}], "tools[0].function = 'no_such_module_x:f': module"),
        ([{"function": "opd_config_tools:missing"}], "has no attribute 'missing'"),
        ([{"function": "opd_config_tools:NOT_CALLABLE"}], "is a int, not a callable"),
        (["calculator", {"function": "opd_config_tools:multiply", "name": "calculator"}], "named twice"),
        ([{"function": "opd_config_tools:multiply", "parameters": {"type": "array"}}], "tools[0]: tool 'multiply'"),
        ([{"function": "opd_config_tools:multiply", "stateful": True, "thread_safe": True}], "not on a thread"),
        ([{"function": "opd_config_tools:multiply", "unknown": 1}], "unknown"),
        (["shell"], "unknown tool(s) ['shell']"),
    ],
)
def test_a_bad_declaration_is_refused_naming_it(tools, message):
    with pytest.raises(ValueError) as raised:
        EnvironmentConfig.model_validate({"tools": tools})
    assert message in str(raised.value)


def test_a_grader_is_named_or_imported():
    turn = StudentTurn("short", (1,), ended=True)
    assert build_environment(EnvironmentConfig(grader="none")).start({"ground_truth": "5"}).step(turn).reward is None
    imported = EnvironmentConfig(grader="opd_config_tools:grade_length")
    assert build_environment(imported).start({}).step(turn).reward == 1.0
    with pytest.raises(ValueError, match="grader = 'opd_config_tools:nothing'"):
        EnvironmentConfig(grader="opd_config_tools:nothing")


def test_failed_calls_give_their_turn_a_reward():
    environment = build_environment(EnvironmentConfig(failed_call_reward=-0.25))
    episode = environment.start({"ground_truth": "42"})
    both = _call("calculator", '{"expression": "6 * 7"}').text + _call("nothing", "{}").text + "<tool_call>{"
    result = episode.step(StudentTurn(both, (1,), ended=True))
    assert result.successful_calls == 1 and result.tool_calls == 3
    assert result.reward == pytest.approx(-0.5)  # two failed calls: an unknown tool and a malformed one
    clean = episode.step(_call("calculator", '{"expression": "1 + 1"}'))
    assert clean.reward == 0.0
    assert build_environment(EnvironmentConfig()).start({}).step(_call("nothing", "{}")).reward is None


def _two_environments(**extra) -> dict:
    return {
        "members": {
            "math": {"tools": ["calculator"]},
            "count": {"tools": [{"function": "opd_config_tools:count_calls"}], "grader": "none"},
        },
        "route_key": "task",
        **extra,
    }


def test_each_example_is_played_in_the_environment_its_field_names():
    environment = build_environment(EnvironmentConfig.model_validate(_two_environments(default="math")))
    assert isinstance(environment, RoutedEnvironment)
    assert environment.route({"task": "count"}) == "count" and environment.route({}) == "math"
    names = {
        member: [tool["function"]["name"] for tool in environment.tool_schemas({ROUTE_FIELD: member}) or []]
        for member in ("math", "count")
    }
    assert names == {"math": ["calculator"], "count": ["count_calls"]}
    math_episode = environment.start({ROUTE_FIELD: "math", "ground_truth": "2"})
    refused = math_episode.step(_call("count_calls", "{}"))
    assert "there is no tool named 'count_calls'" in refused.observation[0]["content"]
    counted = environment.start({ROUTE_FIELD: "count"}).step(_call("count_calls", "{}"))
    assert counted.successful_calls == 1
    assert environment.start({ROUTE_FIELD: "count"}).step(StudentTurn("done", (1,), True)).reward is None


@pytest.mark.parametrize(
    ("example", "message"),
    [({}, 'missing "task" (environment.route_key)'), ({"task": "chess"}, "\"task\" = 'chess' names no environment")],
)
def test_an_example_no_environment_plays_is_a_data_error(example, message):
    environment = build_environment(EnvironmentConfig.model_validate(_two_environments()))
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        environment.route(example)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (_two_environments(tools=["calculator"]), "set ['tools'] in each member"),
        ({k: v for k, v in _two_environments().items() if k != "route_key"}, "needs environment.route_key"),
        (_two_environments(default="chess"), "environment.default = 'chess'"),
        ({"route_key": "task"}, "environment.route_key is for environment.members"),
        ({"members": {}, "route_key": "task"}, "environment.members is empty"),
    ],
)
def test_a_bad_members_section_is_refused(section, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EnvironmentConfig.model_validate(section)
