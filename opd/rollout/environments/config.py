"""The ``environment:`` config section of multi-turn rollouts, and the environment it builds.

``kind`` picks a builder from :data:`ENVIRONMENTS` (a new kind adds an entry there); ``tools`` names built-in tools
from :data:`BUILT_IN_TOOLS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator

from opd.rollout.environments.base import Environment
from opd.rollout.environments.calculator import calculator_tool
from opd.rollout.environments.sandbox import SandboxLimits
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.environments.tools import Tool, ToolRegistry
from opd.utils.config import StrictConfig

BUILT_IN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": calculator_tool}
"""The tools a config can name, each made by its factory."""


class EnvironmentConfig(StrictConfig):
    """``environment``: the student acts over several turns in an environment (tools, a verifier)."""

    kind: Literal["tool"] = Field(
        "tool",
        description="tool = the student calls tools in the chat template's <tool_call> format; the math verifier "
        "grades its final answer",
    )
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="built-in tools shown to the model through the chat template's tools (calculator)",
    )
    max_turns: int = Field(
        4, ge=1, description="most student turns per episode; each turn has generate_strategy's max_length new tokens"
    )
    max_episode_tokens: int | None = Field(
        None,
        ge=2,
        description="most tokens of a whole episode, prompt, turns and observations included (keep it within the "
        "student's and the teacher's context); each turn gets at most the tokens left, and an observation that does "
        "not fit ends the episode (env/truncated_share); null = no limit but max_turns turns of max_length tokens",
    )
    tool_timeout_s: float = Field(
        5.0, gt=0.0, description="longest wait for one tool call; past it the student sees an error"
    )
    tool_max_output_chars: int = Field(
        2000, ge=1, description="longest tool output the student sees; longer output is cut and the cut said"
    )
    tool_isolation: Literal["thread", "process"] = Field(
        "thread",
        description="thread = each call on a thread of the rollout's process (a runaway tool cannot be stopped); "
        "process = in a warm worker process, killed at tool_timeout_s and restarted, its memory capped",
    )

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: list[str]) -> list[str]:
        unknown = [name for name in tools if name not in BUILT_IN_TOOLS]
        if unknown:
            raise ValueError(f"unknown tool(s) {unknown}; the built-in tools are {sorted(BUILT_IN_TOOLS)}")
        if len(set(tools)) != len(tools):
            raise ValueError(f"a tool is named twice in {tools}")
        return tools


def _tool_environment(config: EnvironmentConfig) -> Environment:
    tools = ToolRegistry([BUILT_IN_TOOLS[name]() for name in config.tools])
    limits = SandboxLimits(config.tool_timeout_s, config.tool_max_output_chars, isolation=config.tool_isolation)
    return ToolEnvironment(tools, limits)


ENVIRONMENTS: dict[str, Callable[[EnvironmentConfig], Environment]] = {"tool": _tool_environment}
"""Each ``environment.kind`` and what builds it."""


def build_environment(config: EnvironmentConfig) -> Environment:
    """The environment ``config`` describes."""
    return ENVIRONMENTS[config.kind](config)
