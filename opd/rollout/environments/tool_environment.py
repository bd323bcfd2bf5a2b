"""The tool environment: the student calls tools in the template's format; the verifier gives the reward.

Each call of a turn, malformed ones included, is answered by one ``tool`` message in call order (calls run at once,
in :mod:`opd.rollout.tools.sandbox`, within the limits per call, per turn and per episode; the calls of one
stateful tool run one after another, in order, in the episode's own process), so the student can correct itself.
With ``failed_call_reward`` each failed call adds that much to its turn's reward (a per-turn reward). A turn
without calls, a turn cut at its length limit and the last turn end the episode with the grader's reward (default
:func:`math_reward`), running no tools; so does a turn whose results would not fit under ``max_episode_tokens``
(:meth:`ToolEpisode.stop`).
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
from opd.rollout.environments.tool_calls import MalformedCall, ToolCall, parse_tool_calls
from opd.rollout.tools.outcome import ToolOutcome, failure
from opd.rollout.tools.registry import ToolRegistry
from opd.rollout.tools.sandbox import SandboxLimits, run_tool
from opd.rollout.tools.workers import EpisodeWorkers

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
    a time): a slow tool holds up its own episode, not the others. ``failed_call_reward`` is added to a turn's
    reward for each of its calls that failed (0: no per-turn reward). ``running_calls`` bounds the calls running at
    once (shared by the members of a routed environment; default: ``limits.parallelism`` of this one's own).
    """

    def __init__(
        self,
        tools: ToolRegistry,
        limits: SandboxLimits | None = None,
        grader: Grader = math_reward,
        failed_call_reward: float = 0.0,
        running_calls: threading.BoundedSemaphore | None = None,
    ) -> None:
        self.tools = tools
        self.limits = limits or SandboxLimits()
        self.grader = grader
        self.failed_call_reward = failed_call_reward
        self.parallelism = self.limits.parallelism
        self.running_calls = running_calls or threading.BoundedSemaphore(self.limits.parallelism)

    def start(self, row: Mapping[str, Any]) -> ToolEpisode:
        """An episode on ``row``."""
        return ToolEpisode(self, row)

    def tool_schemas(self, row: Mapping[str, Any] | None = None) -> list[dict[str, Any]] | None:
        """The registered tools' schemas (None without tools)."""
        return self.tools.schemas() or None


class ToolEpisode(Episode):
    """One trajectory in a :class:`ToolEnvironment`: its row, its last turn, the tool time it has used, and the
    processes of its stateful tools (released when it ends)."""

    def __init__(self, environment: ToolEnvironment, row: Mapping[str, Any]) -> None:
        self.environment = environment
        self.row = row
        self.last_text = ""
        self.tool_seconds = 0.0
        self.workers = EpisodeWorkers()

    def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
        """Runs the turn's calls, at once, and answers with their results in call order, or ends with the grade
        (see the module)."""
        self.last_text = turn.text
        calls = parse_tool_calls(turn.text)
        well_formed = sum(not isinstance(call, MalformedCall) for call in calls)
        if not calls or not turn.ended or last_turn:
            self.close()
            reward = self.environment.grader(turn.text, self.row)
            return StepResult([], True, reward, len(calls), well_formed, 0)
        began = time.monotonic()
        outcomes = self._run_calls(calls, self._deadline(began))
        self.tool_seconds += time.monotonic() - began
        messages = [{"role": TOOL_ROLE, "content": outcome.content} for outcome in outcomes]
        succeeded = sum(outcome.ok for outcome in outcomes)
        failed_reward = self.environment.failed_call_reward
        reward = failed_reward * (len(outcomes) - succeeded) if failed_reward else None
        return StepResult(messages, False, reward, len(calls), well_formed, succeeded)

    def stop(self) -> float | None:
        """The grade of the last turn: the episode ends without the student's next turn."""
        self.close()
        return self.environment.grader(self.last_text, self.row)

    def close(self) -> None:
        """Ends the processes of the episode's stateful tools."""
        self.workers.release()

    def _run_calls(self, calls: list[ToolCall | MalformedCall], deadline: float) -> list[ToolOutcome]:
        """The outcomes of a turn's calls, in call order: up to the cap, run at once, except that the calls of one
        stateful tool run in order, one after another (each may read what the one before it left)."""
        cap = self.environment.limits.max_calls_per_turn
        lanes: dict[object, list[int]] = {}  # calls that must run in order share a lane
        for index, call in enumerate(calls[:cap]):
            tool = None if isinstance(call, MalformedCall) else self.environment.tools.get(call.name)
            lanes.setdefault(tool.name if tool is not None and tool.stateful else index, []).append(index)
        outcomes: list[ToolOutcome | None] = [None] * min(len(calls), cap)

        def run_lane(indices: list[int]) -> None:
            for index in indices:
                outcomes[index] = self._answer(calls[index], deadline)

        with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="tool-call") as pool:
            for future in [pool.submit(run_lane, indices) for indices in lanes.values()]:
                future.result()
        refused = [self._refused(f"more than {cap} calls in one turn: this one was not run") for _ in calls[cap:]]
        return [outcome for outcome in outcomes if outcome is not None] + refused

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
            return run_tool(environment.tools.get(call.name), call.name, call.arguments, limits, self.workers)
