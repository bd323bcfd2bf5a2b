"""The tool environment: the student calls tools in the template's format; the verifier gives the reward.

Each call of a turn, malformed ones included, is answered by one ``tool`` message in call order (calls run in
:mod:`opd.rollout.environments.sandbox`), so the student can correct itself. A turn without calls, a turn cut at
its length limit and the last turn end the episode with the grader's reward (default :func:`math_reward`), running
no tools; so does a turn whose results would not fit under ``max_episode_tokens`` (:meth:`ToolEpisode.stop`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from opd.rollout.environments.base import Environment, Episode, StepResult, StudentTurn
from opd.rollout.environments.math_verifier import is_correct
from opd.rollout.environments.sandbox import SandboxLimits, failure, run_tool
from opd.rollout.environments.tool_calls import MalformedCall, parse_tool_calls
from opd.rollout.environments.tools import ToolRegistry

Grader = Callable[[str, Mapping[str, Any]], float | None]
"""Grades the final turn's text against its row: the episode's reward (None: no reward)."""

TOOL_ROLE = "tool"


def math_reward(answer: str, row: Mapping[str, Any]) -> float | None:
    """1.0 when the math verifier accepts ``answer`` for the row's ``ground_truth``, else 0.0 (None without one)."""
    ground_truth = row.get("ground_truth")
    if ground_truth is None:
        return None
    return 1.0 if is_correct(answer, str(ground_truth)) else 0.0


class ToolEnvironment(Environment):
    """Runs the student's tool calls within ``limits``; ``grader`` gives the final reward."""

    def __init__(self, tools: ToolRegistry, limits: SandboxLimits | None = None, grader: Grader = math_reward) -> None:
        self.tools = tools
        self.limits = limits or SandboxLimits()
        self.grader = grader

    def start(self, row: Mapping[str, Any]) -> ToolEpisode:
        """An episode on ``row``."""
        return ToolEpisode(self, row)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The registered tools' schemas (None without tools)."""
        return self.tools.schemas() or None


class ToolEpisode(Episode):
    """One trajectory in a :class:`ToolEnvironment`."""

    def __init__(self, environment: ToolEnvironment, row: Mapping[str, Any]) -> None:
        self.environment = environment
        self.row = row
        self.last_text = ""

    def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
        """Runs the turn's calls and answers with their results, or ends with the grade (see the module)."""
        self.last_text = turn.text
        calls = parse_tool_calls(turn.text)
        well_formed = sum(not isinstance(call, MalformedCall) for call in calls)
        if not calls or not turn.ended or last_turn:
            reward = self.environment.grader(turn.text, self.row)
            return StepResult([], True, reward, len(calls), well_formed, 0)
        outcomes = [
            failure(f"malformed tool call: {call.reason}", self.environment.limits.max_output_chars)
            if isinstance(call, MalformedCall)
            else run_tool(self.environment.tools.get(call.name), call.name, call.arguments, self.environment.limits)
            for call in calls
        ]
        messages = [{"role": TOOL_ROLE, "content": outcome.content} for outcome in outcomes]
        return StepResult(messages, False, None, len(calls), well_formed, sum(outcome.ok for outcome in outcomes))

    def stop(self) -> float | None:
        """The grade of the last turn: the episode ends without the student's next turn."""
        return self.environment.grader(self.last_text, self.row)
