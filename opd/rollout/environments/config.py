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
    tool_max_memory_mb: int | None = Field(
        2048, ge=1, description="address space of a tool's worker process (process isolation, Linux); null = no cap"
    )
    tool_isolation: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="auto = tools declared safe (the calculator) on a thread, every other tool in a process; "
        "thread = each call on a thread of the rollout's process (it can neither be stopped nor its memory capped, "
        "and its prints reach the run's output); process = in a warm worker process, killed at tool_timeout_s with "
        "every process it started, its memory capped, its prints dropped",
    )
    tool_calls_per_turn: int = Field(
        8, ge=1, description="calls of one turn that run; further calls are answered with an error, not run"
    )
    tool_time_per_turn_s: float | None = Field(
        None,
        gt=0.0,
        description="wall time one turn's calls may take together; a call gets at most what is left and one that "
        "starts after it is spent is not run; null = each call's own limit only",
    )
    tool_time_per_episode_s: float | None = Field(
        None, gt=0.0, description="the same over all turns of an episode; null = no cap"
    )
    parallelism: int = Field(
        8,
        ge=1,
        description="episodes stepped at once and tool calls running at once (over all episodes); a slow tool "
        "holds up its own episode only",
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
    limits = SandboxLimits(
        timeout_s=config.tool_timeout_s,
        max_output_chars=config.tool_max_output_chars,
        isolation=config.tool_isolation,
        max_memory_mb=config.tool_max_memory_mb,
        max_calls_per_turn=config.tool_calls_per_turn,
        turn_time_s=config.tool_time_per_turn_s,
        episode_time_s=config.tool_time_per_episode_s,
        parallelism=config.parallelism,
    )
    return ToolEnvironment(tools, limits)


ENVIRONMENTS: dict[str, Callable[[EnvironmentConfig], Environment]] = {"tool": _tool_environment}
"""Each ``environment.kind`` and what builds it."""


def build_environment(config: EnvironmentConfig) -> Environment:
    """The environment ``config`` describes."""
    return ENVIRONMENTS[config.kind](config)
