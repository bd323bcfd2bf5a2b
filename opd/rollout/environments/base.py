"""The environment interface: an episode answers the student's turns until it ends.

A multi-turn rollout (:mod:`opd.rollout.multi_turn`) runs one :class:`Episode` per
sampled trajectory. The episode starts from a dataset row (:meth:`Environment.start`);
after each of the student's turns it answers with the next observation, as chat messages
(a ``tool`` message with a tool's result, or a ``user`` message), or with the end of the
episode and an optional reward. The environment never sees token ids of observations: the
rollout renders its messages through the chat template and tokenises them once
(:mod:`opd.rollout.environments.turn_template`), so one environment serves every template.

An environment is a plain Python object: it holds no model and no device, so the same
environment runs in the driver's process or inside a rollout worker.
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
        token_ids: the turn's ids as generated, its stop token included when it has one.
        ended: the turn ended at a stop token; False when it was cut at the turn's length limit.
    """

    text: str
    token_ids: tuple[int, ...]
    ended: bool


@dataclass(frozen=True)
class StepResult:
    """What an episode answers to one student turn.

    Attributes:
        observation: the chat messages the student sees next (``{"role", "content"}``);
            empty when the episode ended.
        done: the episode ended with this turn.
        reward: the episode's final reward (only where ``done``; None: no reward, e.g. a
            row without a ground truth).
        tool_calls: calls the turn made (every ``<tool_call>`` opened, well formed or not).
        well_formed_calls: calls that parsed (a known or unknown tool name, arguments an object).
        successful_calls: calls whose tool ran and returned within its limits.
    """

    observation: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    well_formed_calls: int = 0
    successful_calls: int = 0


class Episode(ABC):
    """One trajectory's environment state, from the row it started on to its end."""

    @abstractmethod
    def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
        """Answers the student's ``turn``.

        Args:
            turn: the turn just generated.
            last_turn: no further turn can follow (the rollout reached ``max_turns``): the
                episode ends here and gives its reward without acting on the turn (no tool runs).

        Returns:
            The next observation, or the end (``done``) with the reward. Failures of what
            the turn asked for (a malformed call, a failing tool) are observations, never
            exceptions.
        """

    def stop(self) -> float | None:
        """The rollout ends the episode after the turn just answered (the whole episode reached
        ``max_episode_tokens``: the observation it answered with does not fit).

        Returns:
            The episode's final reward, graded as if that turn had been the last one allowed
            (the default: None, no reward).
        """
        return None


class Environment(ABC):
    """Makes episodes from dataset rows, and says which tools the chat template lists."""

    @abstractmethod
    def start(self, row: Mapping[str, Any]) -> Episode:
        """A new episode for ``row`` (a dataset row: its ``messages``, ``ground_truth``, ...)."""

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas, passed as the chat template's ``tools``; None without tools."""
        return None
