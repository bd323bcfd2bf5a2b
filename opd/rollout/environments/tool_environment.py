"""The tool environment: the student calls tools in the template's format; the verifier gives the reward.

Each call of a turn, malformed ones included, is answered by one ``tool`` message in call order (calls run at once,
in :mod:`opd.rollout.environments.sandbox`, within the limits per call, per turn and per episode), so the student
can correct itself. A turn without calls, a turn cut at
its length limit and the last turn end the episode with the grader's reward (default :func:`math_reward`), running
no tools; so does a turn whose results would not fit under ``max_episode_tokens`` (:meth:`ToolEpisode.stop`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from opd.rollout.environments.base import Environment, Episode, StepResult, StudentTurn
from opd.rollout.environments.math_verifier import is_correct
from opd.rollout.environments.sandbox import SandboxLimits, ToolOutcome, failure, run_tool
from opd.rollout.environments.tool_calls import MalformedCall, ToolCall, parse_tool_calls
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
    """Runs the student's tool calls within ``limits``; ``grader`` gives the final reward.

    At most ``limits.parallelism`` calls run at once over all of its episodes (which the rollout steps that many at
    a time): a slow tool holds up its own episode, not the others.
    """

    def __init__(self, tools: ToolRegistry, limits: SandboxLimits | None = None, grader: Grader = math_reward) -> None:
        self.tools = tools
        self.limits = limits or SandboxLimits()
        self.grader = grader
        self.parallelism = self.limits.parallelism
        self.running_calls = threading.BoundedSemaphore(self.limits.parallelism)

    def start(self, row: Mapping[str, Any]) -> ToolEpisode:
        """An episode on ``row``."""
        return ToolEpisode(self, row)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The registered tools' schemas (None without tools)."""
        return self.tools.schemas() or None


class ToolEpisode(Episode):
    """One trajectory in a :class:`ToolEnvironment`: its row, its last turn, and the tool time it has used."""

    def __init__(self, environment: ToolEnvironment, row: Mapping[str, Any]) -> None:
        self.environment = environment
        self.row = row
        self.last_text = ""
        self.tool_seconds = 0.0

    def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
        """Runs the turn's calls, at once, and answers with their results in call order, or ends with the grade
        (see the module)."""
        self.last_text = turn.text
        calls = parse_tool_calls(turn.text)
        well_formed = sum(not isinstance(call, MalformedCall) for call in calls)
        if not calls or not turn.ended or last_turn:
            reward = self.environment.grader(turn.text, self.row)
            return StepResult([], True, reward, len(calls), well_formed, 0)
        began = time.monotonic()
        deadline = self._deadline(began)
        cap = self.environment.limits.max_calls_per_turn
        with ThreadPoolExecutor(max_workers=min(len(calls), cap), thread_name_prefix="tool-call") as pool:
            running = [pool.submit(self._answer, call, deadline) for call in calls[:cap]]
            outcomes = [future.result() for future in running]
        outcomes += [self._refused(f"more than {cap} calls in one turn: this one was not run") for _ in calls[cap:]]
        self.tool_seconds += time.monotonic() - began
        messages = [{"role": TOOL_ROLE, "content": outcome.content} for outcome in outcomes]
        return StepResult(messages, False, None, len(calls), well_formed, sum(outcome.ok for outcome in outcomes))

    def stop(self) -> float | None:
        """The grade of the last turn: the episode ends without the student's next turn."""
        return self.environment.grader(self.last_text, self.row)

    def _deadline(self, began: float) -> float:
        """When this turn's calls must be done: the turn's budget, or what is left of the episode's if sooner."""
        limits = self.environment.limits
        ends = [math.inf]
        if limits.turn_time_s is not None:
            ends.append(began + limits.turn_time_s)
        if limits.episode_time_s is not None:
            ends.append(began + limits.episode_time_s - self.tool_seconds)
        return min(ends)

    def _refused(self, reason: str) -> ToolOutcome:
        return failure(reason, self.environment.limits.max_output_chars)

    def _answer(self, call: ToolCall | MalformedCall, deadline: float) -> ToolOutcome:
        """One call's outcome: run within the call's limit and what is left of the turn's and episode's time."""
        environment = self.environment
        if isinstance(call, MalformedCall):
            return self._refused(f"malformed tool call: {call.reason}")
        with environment.running_calls:
            left = deadline - time.monotonic()
            if left <= 0:
                return self._refused(f"{call.name} was not run: the tool time of this turn or episode is spent")
            limits = environment.limits
            if left < limits.timeout_s:
                limits = replace(limits, timeout_s=left)
            return run_tool(environment.tools.get(call.name), call.name, call.arguments, limits)
