"""The environment interface: an episode answers the student's turns until it ends.

A multi-turn rollout (:mod:`opd.rollout.multi_turn`) runs one :class:`Episode` per trajectory, started from a
dataset row. It answers each turn with chat messages or with the end and an optional reward; the rollout renders
the messages (:mod:`opd.rollout.environments.turn_template`), so one environment serves every chat template. An
environment holds no model and no device, so it runs in the driver's process or in a rollout worker.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StudentTurn:
    """One turn the student generated.

    Attributes:
        text: the turn decoded without special tokens (what a parser and a verifier read).
        token_ids: the turn's ids as generated, its stop token included.
        ended: the turn ended at a stop token, not at the turn's length limit.
    """

    text: str
    token_ids: tuple[int, ...]
    ended: bool


@dataclass(frozen=True)
class StepResult:
    """What an episode answers to one student turn.

    Attributes:
        observation: the chat messages (``{"role", "content"}``) the student sees next; empty when ``done``.
        reward: the reward of this turn: where ``done`` the final one (None: no reward, e.g. a row without a
            ground truth), else a per-turn reward (None: none for this turn). An episode's return is their sum.
        tool_calls: every ``<tool_call>`` opened; ``well_formed_calls`` those that parsed (any tool name);
            ``successful_calls`` those whose tool returned within its limits.
    """

    observation: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    well_formed_calls: int = 0
    successful_calls: int = 0


class Episode(ABC):
    """One trajectory's environment state, from the row it started on to its end.

    Its life: :meth:`Environment.start` creates it, :meth:`step` answers each turn, :meth:`close` releases what it
    holds (a stateful tool's process). The rollout closes every episode it started, however it ends.
    """

    @abstractmethod
    def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
        """Answers the student's ``turn``: the next observation, or the end (``done``) with the reward.

        With ``last_turn`` (``max_turns`` reached) the episode ends and gives its reward without acting on the turn.
        Failures of what the turn asked for (a malformed call, a failing tool) are observations, never exceptions.
        """

    def stop(self) -> float | None:
        """The final reward when the rollout ends the episode because its observation would pass ``max_episode_tokens``.

        Graded as if the turn just answered had been the last one allowed (default: None, no reward).
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional: most episodes hold nothing to release
        """Releases what the episode holds; called once it ended (or the rollout stopped), more than once allowed."""


class Environment(ABC):
    """Makes episodes from dataset rows, and says which tools the chat template lists."""

    parallelism: int = 1
    """Episodes the rollout steps at once (threads): more than 1 only where :meth:`Episode.step` of different
    episodes may run concurrently."""

    @abstractmethod
    def start(self, row: Mapping[str, Any]) -> Episode:
        """A new episode for ``row`` (a dataset row: its ``messages``, ``ground_truth``, ...)."""

    def route(self, example: Mapping[str, Any]) -> str | None:
        """The name of the environment that plays a dataset example, where a run has several (None: this one).

        Read once, when the data is loaded; a row it cannot place raises :class:`~opd.utils.errors.DataError`.
        """
        return None

    def tool_schemas(self, row: Mapping[str, Any] | None = None) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas for ``row``'s episodes (None without tools), passed as the chat template's
        ``tools``; the same for every row unless the environment routes rows to several."""
        return None
