"""The ``environment:`` section builds its environment; a wrong key or tool name fails naming it."""

from __future__ import annotations

import pydantic
import pytest

from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.config import EnvironmentConfig, build_environment


def test_builds_the_tool_environment_with_its_limits():
    config = EnvironmentConfig(tools=["calculator"], max_turns=3, tool_timeout_s=1.5, tool_max_output_chars=4)
    environment = build_environment(config)
    assert [schema["function"]["name"] for schema in environment.tool_schemas() or []] == ["calculator"]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12345 * 10"}}\n</tool_call>'
    (message,) = environment.start({}).step(StudentTurn(call, (), True)).observation
    assert message["content"].startswith("1234\n[output cut: 6 characters, the limit is 4]")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": ["shell"]}, "unknown tool"),
        ({"tools": ["calculator", "calculator"]}, "named twice"),
        ({"max_turns": 0}, "max_turns"),
        ({"kind": "browser"}, "kind"),
        ({"tool_timeout": 3}, "tool_timeout"),
    ],
)
def test_bad_sections_are_refused(fields, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        EnvironmentConfig(**fields)
