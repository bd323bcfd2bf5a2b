"""The ``environment:`` config section of multi-turn rollouts, and the environment it builds.

``kind`` picks a builder from :data:`ENVIRONMENTS` (a new kind adds an entry there). ``tools`` names built-in
tools from :data:`BUILT_IN_TOOLS` and declares others (:class:`~opd.rollout.tools.specs.ToolSpec`);
``grader`` names a grader from :data:`GRADERS` or an importable one. With ``members``, each example is played in
the member its ``route_key`` field names (:class:`~opd.rollout.environments.routed_environment.RoutedEnvironment`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from opd.rollout.environments.base import Environment
from opd.rollout.environments.routed_environment import RoutedEnvironment
from opd.rollout.environments.tool_environment import Grader, ToolEnvironment, math_reward
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.mcp_tools import McpServerConfig, mcp_tools
from opd.rollout.tools.python_tool import python_tool
from opd.rollout.tools.registry import Tool, ToolRegistry
from opd.rollout.tools.sandbox import SandboxLimits
from opd.rollout.tools.specs import ToolSpec, import_callable
from opd.utils.config import StrictConfig

BUILT_IN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": calculator_tool, "python": python_tool}
"""The tools a config can name, each made by its factory."""


def no_reward(answer: str, row: Mapping[str, Any]) -> float | None:
    """No final reward (an environment whose turns carry the rewards, or none at all)."""
    return None


GRADERS: dict[str, Grader] = {"math": math_reward, "none": no_reward}
"""The graders a config can name; any other ``grader`` is imported as ``package.module:attribute``."""


class ToolSetConfig(StrictConfig):
    """What one environment offers: its tools, how its final turn is graded, what a failed call is worth."""

    tools: list[str | ToolSpec] = Field(
        default_factory=lambda: list[str | ToolSpec](["calculator"]),
        description="the tools shown to the model through the chat template's tools: built-in ones by name "
        "(calculator: arithmetic parsed with ast; python: runs code, its variables kept for the episode) and "
        "declared ones ({function: package.module:attribute, name, description, parameters, thread_safe, "
        "stateful}; parameters null = the JSON schema of its type hints)",
    )
    mcp_servers: list[McpServerConfig] = Field(
        default_factory=list,
        description="MCP servers whose tools are offered too (stdio; pip install 'opd[mcp]'): each {command: [...], "
        "env, tools: [names] or null for all, prefix, timeout_s}; started when the environment is built",
    )
    grader: str = Field(
        "math",
        description="the final reward: math (the math verifier against the row's ground_truth), none, or "
        "package.module:attribute, called as grader(final_turn_text, row) -> float | None",
    )
    failed_call_reward: float = Field(
        0.0,
        description="added to a turn's reward for each of its tool calls that failed (malformed, refused, raised, "
        "timed out); a per-turn reward, e.g. -0.1; 0 = none",
    )

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, tools: list[str | ToolSpec]) -> list[str | ToolSpec]:
        unknown = [name for name in tools if isinstance(name, str) and name not in BUILT_IN_TOOLS]
        if unknown:
            raise ValueError(f"unknown tool(s) {unknown}; the built-in tools are {sorted(BUILT_IN_TOOLS)}")
        names = [tool.name for tool in _build_tools(tools, "tools")]  # declared tools are imported and checked now
        if len(set(names)) != len(names):
            raise ValueError(f"a tool is named twice in {names}")
        return tools

    @field_validator("grader")
    @classmethod
    def _known_grader(cls, grader: str) -> str:
        if grader not in GRADERS:
            import_callable(grader, "grader")
        return grader

    def registry(self, key: str = "environment") -> ToolRegistry:
        """The tools, built, and the MCP servers' tools (each server started, if this process has not yet).

        Raises:
            ValueError: two tools have one name (an MCP server's ``prefix`` keeps them apart).
        """
        registry = ToolRegistry(_build_tools(self.tools, f"{key}.tools"))
        for index, server in enumerate(self.mcp_servers):
            for tool in mcp_tools(server):
                if registry.get(tool.name) is not None:
                    raise ValueError(
                        f"{key}.mcp_servers[{index}] offers a tool named {tool.name!r}, as another tool is; give "
                        "the server a prefix"
                    )
                registry.add(tool)
        return registry

    def grader_function(self) -> Grader:
        """The grader named by ``grader``."""
        return GRADERS[self.grader] if self.grader in GRADERS else import_callable(self.grader, "grader")


def _build_tools(tools: list[str | ToolSpec], key: str) -> list[Tool]:
    return [
        BUILT_IN_TOOLS[tool]() if isinstance(tool, str) else tool.build(f"{key}[{index}]")
        for index, tool in enumerate(tools)
    ]


class EnvironmentConfig(ToolSetConfig):
    """``environment``: the student acts over several turns in an environment (tools, a verifier), or in one of
    several (``members``), chosen per example."""

    kind: Literal["tool"] = Field(
        "tool",
        description="tool = the student calls tools in the chat template's <tool_call> format; the grader "
        "grades its final answer",
    )
    members: dict[str, ToolSetConfig] | None = Field(
        None,
        description="several environments in one run, by name, each with its own tools, grader and "
        "failed_call_reward (then not set here); each example is played in the one its route_key field names",
    )
    route_key: str | None = Field(None, description="members: the dataset field naming each example's environment")
    default: str | None = Field(None, description="members: the environment of examples without the field")
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

    @model_validator(mode="after")
    def _members_or_tools(self) -> EnvironmentConfig:
        if self.members is None:
            stray = [key for key in ("route_key", "default") if getattr(self, key) is not None]
            if stray:
                raise ValueError(f"environment.{stray[0]} is for environment.members (several environments)")
            return self
        if not self.members:
            raise ValueError("environment.members is empty; name at least one environment")
        if self.route_key is None:
            raise ValueError("environment.members needs environment.route_key (the dataset field naming each one)")
        if self.default is not None and self.default not in self.members:
            raise ValueError(f"environment.default = {self.default!r} is not one of {sorted(self.members)}")
        own = sorted(set(ToolSetConfig.model_fields) & self.model_fields_set)
        if own:
            raise ValueError(f"with environment.members, set {own} in each member, not in environment")
        return self


def _tool_environment(config: EnvironmentConfig) -> Environment:
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
    if config.members is None:
        return ToolEnvironment(config.registry(), limits, config.grader_function(), config.failed_call_reward)
    running_calls = threading.BoundedSemaphore(limits.parallelism)  # parallelism bounds all members' calls together
    members: dict[str, Environment] = {
        name: ToolEnvironment(
            member.registry(f"environment.members.{name}"),
            limits,
            member.grader_function(),
            member.failed_call_reward,
            running_calls,
        )
        for name, member in config.members.items()
    }
    assert config.route_key is not None  # checked with the members
    return RoutedEnvironment(members, config.route_key, config.default)


ENVIRONMENTS: dict[str, Callable[[EnvironmentConfig], Environment]] = {"tool": _tool_environment}
"""Each ``environment.kind`` and what builds it."""


def build_environment(config: EnvironmentConfig) -> Environment:
    """The environment ``config`` describes."""
    return ENVIRONMENTS[config.kind](config)
