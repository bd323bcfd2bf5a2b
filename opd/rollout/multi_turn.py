"""Multi-turn rollouts: the student's turns and an environment's answers, up to ``max_turns``.

Built on :meth:`GenerationInterface.generate` alone, so every engine samples them. Each turn is one ``generate``
call over the running episodes, with the trajectory so far as the prompt. A turn ends at a stop token or at the
template's end-of-turn token (:meth:`TurnTemplate.turn_end_ids`, which a base model's tokenizer may not stop at;
what follows it is dropped); a turn cut at ``strategy.max_length`` ends its episode. With ``max_episode_tokens``
the whole sequence never exceeds that many tokens: a turn gets at most the tokens left, and an observation that
leaves no room ends the episode (:meth:`~opd.rollout.environments.base.Episode.stop` gives the reward).

Ids are never re-tokenised (prompt, each turn as generated, each observation tokenised once by
:class:`~opd.rollout.environments.turn_template.TurnTemplate`), so the teacher scores exactly the sampled ids.
The batch is a single-turn rollout's, with everything after the prompt as the "response", plus ``token_mask``:
1 on the student's tokens (stop tokens included), 0 on prompt, observations and padding, where the sampler's
log-probs are 0 too; and ``episode_layout``, each row's turns and messages (:class:`EpisodeLayout`), from which a
teacher with another tokenizer renders the observations in its own chat template.

Rewards: an environment may reward any turn (:attr:`~opd.rollout.environments.base.StepResult.reward`), the last
one with the final reward. A student token's task reward is its return: the sum of the rewards of its own turn and
every later turn (:meth:`MultiTurnRollout.task_rewards`); with a final reward alone, every token of an episode
gets that reward, as in a single-turn rollout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import GenerationInterface
from opd.rollout.environments.base import Environment, Episode, StepResult, StudentTurn
from opd.rollout.environments.config import EnvironmentConfig, build_environment
from opd.rollout.environments.routed_environment import ROUTE_FIELD
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.rollout_batch import build_rollout_batch


@dataclass
class EpisodeRecord:
    """What one episode did (its metrics).

    Attributes:
        environment_seconds: time in the environment's steps (tools, grading) and in rendering observations.
        reward: the final reward (None: the environment gave none).
        turn_rewards: the reward of each student turn before the last (None where the environment gave none).
        truncated: the last turn was cut at the turn's length limit.
        capped: ``max_episode_tokens`` ended the episode (last turn cut, or the next observation did not fit).
    """

    turns: int = 0
    tool_calls: int = 0
    well_formed_calls: int = 0
    successful_calls: int = 0
    environment_seconds: float = 0.0
    reward: float | None = None
    turn_rewards: list[float | None] = field(default_factory=list)
    truncated: bool = False
    capped: bool = False

    def returns(self) -> list[float]:
        """Each student turn's return: its reward plus every later turn's, the final reward included (0 for none)."""
        rewards = [reward or 0.0 for reward in self.turn_rewards] + [self.reward or 0.0]
        returns, total = [], 0.0
        for reward in reversed(rewards):
            total += reward
            returns.append(total)
        return returns[::-1][: self.turns]


@dataclass
class _Trajectory:
    """One episode while it runs."""

    prompt_ids: list[int]
    history: list[dict[str, Any]]
    episode: Episode
    template: TurnTemplate  # renders its observations with its environment's tools
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # each student turn's ``[start, end)`` in ids
    answered: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)  # (turn's content, observation)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    record: EpisodeRecord = field(default_factory=EpisodeRecord)


@dataclass
class MultiTurnRollout:
    """A multi-turn rollout: the training batch (see the module docstring) and one record per row."""

    batch: BatchedDataDict
    episodes: list[EpisodeRecord]
    environment_seconds: float = 0.0
    """Wall time in the environment (its steps, grading and rendering observations); episodes are stepped at
    once, so it is less than the sum of the episodes' own times."""

    def rewards(self) -> torch.Tensor:
        """``[N]`` float32 final rewards (NaN where an episode has none)."""
        return torch.tensor(
            [math.nan if record.reward is None else record.reward for record in self.episodes], dtype=torch.float32
        )

    def task_rewards(self) -> torch.Tensor:
        """The task reward of the batch's tokens: ``[N]`` final rewards (0 for none) where no turn before the last
        was rewarded, else ``[N, L]``, each student token's return (see the module; 0 elsewhere)."""
        if not any(reward is not None for record in self.episodes for reward in record.turn_rewards):
            return torch.nan_to_num(self.rewards(), nan=0.0)
        per_token = torch.zeros(self.batch["input_ids"].shape, dtype=torch.float32)
        for row, (record, layout) in enumerate(zip(self.episodes, self.batch["episode_layout"], strict=True)):
            prompt_length = int(self.batch["prompt_lengths"][row])
            for (start, end), value in zip(layout["turns"], record.returns(), strict=True):
                per_token[row, prompt_length + start : prompt_length + end] = value
        return per_token

    def metrics(self) -> dict[str, float]:
        """The episodes' metrics (:func:`episode_metrics`) and the environment's wall time in seconds."""
        return {**episode_metrics(self.episodes), "timing/environment": self.environment_seconds}


def episode_metrics(records: Sequence[EpisodeRecord]) -> dict[str, float]:
    """Means over the episodes.

    ``env/truncated_share`` is the share of episodes ``max_episode_tokens`` ended; the call shares are over all
    calls, ``env/reward`` over rewarded episodes and ``env/turn_reward`` over rewarded turns before the last (each
    absent when there are none).
    """
    count = max(len(records), 1)
    calls = sum(record.tool_calls for record in records)
    metrics = {
        "env/turns": sum(record.turns for record in records) / count,
        "env/tool_calls": calls / count,
        "env/truncated_share": sum(record.capped for record in records) / count,
    }
    if calls:
        metrics["env/well_formed_share"] = sum(record.well_formed_calls for record in records) / calls
        metrics["env/success_share"] = sum(record.successful_calls for record in records) / calls
    rewards = [record.reward for record in records if record.reward is not None]
    if rewards:
        metrics["env/reward"] = sum(rewards) / len(rewards)
    turn_rewards = [reward for record in records for reward in record.turn_rewards if reward is not None]
    if turn_rewards:
        metrics["env/turn_reward"] = sum(turn_rewards) / len(turn_rewards)
    return metrics


@dataclass(frozen=True)
class Episodes:
    """The environment and limits of a run's episodes (``max_episode_tokens`` counts the prompt too).

    Training (:class:`~opd.distillation.step.RolloutSchedule`) and validation
    (:func:`~opd.run.validation.validate`) run the same episodes from it.
    """

    environment: Environment
    max_turns: int
    max_episode_tokens: int | None = None

    @classmethod
    def from_config(cls, config: EnvironmentConfig | None) -> Episodes | None:
        """The episodes of an ``environment:`` section (None without one: one turn per rollout)."""
        if config is None:
            return None
        return cls(build_environment(config), config.max_turns, config.max_episode_tokens)

    def tools_of(self, example: Mapping[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
        """A dataset example's environment (None where the run has one) and the tools its prompt lists
        (:data:`~opd.data.dataloaders.ToolsOf`); DataError for an example no environment plays."""
        name = self.environment.route(example)
        row = example if name is None else {ROUTE_FIELD: name}
        return name, self.environment.tool_schemas(row) or []

    def rollout(
        self,
        generation: GenerationInterface,
        tokenizer: Any,
        examples: Sequence[Mapping[str, Any]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
        prompt_key: str | None = None,
    ) -> MultiTurnRollout:
        """The episodes of prepared examples (their ``prompt_messages`` and ``ground_truth``).

        ``generation`` must be switched on by the caller; ``tokenizer``'s chat template joins the turns.
        ``prompt_key`` takes each prompt's ids from ``example[prompt_key]`` (a teacher's own prompt:
        ``teacher_prompt_ids``); None renders ``prompt_messages`` with the tools.

        Raises:
            ValueError: an example has no ``prompt_messages`` (it was loaded without the tools).
        """
        if any("prompt_messages" not in example for example in examples):
            raise ValueError("multi-turn episodes need each example's prompt_messages (prepare_examples with tools)")
        rows = [_row(example) for example in examples]
        return multi_turn_rollout(
            generation,
            self.environment,
            [TurnTemplate(tokenizer, self.environment.tool_schemas(row)) for row in rows],
            rows,
            [example["prompt_messages"] for example in examples],
            strategy,
            self.max_turns,
            tokenizer.pad_token_id,
            num_samples,
            return_logprobs,
            prompt_ids=None if prompt_key is None else [list(example[prompt_key]) for example in examples],
            max_episode_tokens=self.max_episode_tokens,
        )


def _row(example: Mapping[str, Any]) -> dict[str, Any]:
    """What an episode starts from: the example's ground truth and, where a run has several, its environment."""
    row = {"ground_truth": example.get("ground_truth")}
    if ROUTE_FIELD in example:
        row[ROUTE_FIELD] = example[ROUTE_FIELD]
    return row


def multi_turn_rollout(
    generation: GenerationInterface,
    environment: Environment,
    template: TurnTemplate | Sequence[TurnTemplate],
    rows: Sequence[Mapping[str, Any]],
    prompt_messages: Sequence[list[dict[str, Any]]],
    strategy: GenerateStrategyConfig,
    max_turns: int,
    pad_token_id: int,
    num_samples: int = 1,
    return_logprobs: bool = True,
    prompt_ids: Sequence[list[int]] | None = None,
    max_episode_tokens: int | None = None,
) -> MultiTurnRollout:
    """Runs ``num_samples`` episodes per row, turn by turn, and lays them out as a training batch.

    The caller switches the engine on (:meth:`GenerationInterface.prepare_for_generation`), as for ``generate``.

    Args:
        template: how the chat template joins turns, or one per row (rows whose environments list different tools).
        prompt_messages: each row's prompt conversation (up to the first assistant turn).
        strategy: sampling of each turn (``max_length``: new tokens per turn).
        num_samples: episodes per row (adjacent in the batch).
        prompt_ids: each row's prompt ids where they are not ``template``'s rendering of ``prompt_messages`` (a
            teacher's prompt with teacher-only context); observations still follow the messages.

    Raises:
        ValueError: ``max_turns`` < 1, the per-row lists differ in length, or a prompt leaves no room for a turn
            under ``max_episode_tokens``.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if len(rows) != len(prompt_messages):
        raise ValueError(f"{len(rows)} rows but {len(prompt_messages)} prompt conversations")
    if prompt_ids is not None and len(prompt_ids) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(prompt_ids)} prompts")
    templates = [template] * len(rows) if isinstance(template, TurnTemplate) else list(template)
    if len(templates) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(templates)} templates")
    trajectories: list[_Trajectory] = []
    for position, (row, messages, row_template) in enumerate(zip(rows, prompt_messages, templates)):
        prompt = row_template.prompt_ids(messages) if prompt_ids is None else list(prompt_ids[position])
        if max_episode_tokens is not None and len(prompt) >= max_episode_tokens:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens leaves no room for a turn under environment.max_episode_tokens "
                f"= {max_episode_tokens}; raise it above data.max_prompt_length"
            )
        trajectories += [
            _Trajectory(prompt, list(messages), environment.start(row), row_template) for _ in range(num_samples)
        ]
    try:
        seconds = _play(generation, environment, trajectories, strategy, max_turns, return_logprobs, max_episode_tokens)
    finally:  # whatever ended the rollout, no episode keeps what it holds (a stateful tool's process)
        for trajectory in trajectories:
            trajectory.episode.close()
    records = [trajectory.record for trajectory in trajectories]
    return MultiTurnRollout(_batch(trajectories, pad_token_id, return_logprobs), records, seconds)


def _play(
    generation: GenerationInterface,
    environment: Environment,
    trajectories: list[_Trajectory],
    strategy: GenerateStrategyConfig,
    max_turns: int,
    return_logprobs: bool,
    max_episode_tokens: int | None,
) -> float:
    """Plays the episodes turn by turn until each ends or ``max_turns`` turns were played; returns the wall time
    spent in the environment."""
    environment_seconds = 0.0
    if not trajectories:
        return environment_seconds
    tokenizer = trajectories[0].template.tokenizer
    turn_ends = set(trajectories[0].template.turn_end_ids())  # the chat template's, whatever tools a row lists
    running = list(trajectories)
    for turn_index in range(max_turns):
        if not running:
            break
        rooms = [_room(trajectory, max_episode_tokens) for trajectory in running]
        turn_strategy = strategy
        if min(rooms) < strategy.max_length:  # the cap shortens some turn: no turn needs more than the most room
            turn_strategy = strategy.model_copy(update={"max_length": max(1, min(strategy.max_length, max(rooms)))})
        turns = generation.generate(
            [trajectory.prompt_ids + trajectory.ids for trajectory in running],
            turn_strategy,
            num_samples=1,
            return_logprobs=return_logprobs,
        )
        appended = [
            _append_turn(trajectory, turns, position, rooms[position], strategy.max_length, turn_ends, return_logprobs)
            for position, trajectory in enumerate(running)
        ]
        student_turns = [
            StudentTurn(tokenizer.decode(turn_ids, skip_special_tokens=True), tuple(turn_ids), ended)
            for turn_ids, ended in appended
        ]
        turn_began = time.perf_counter()
        results = _step_episodes(environment, running, student_turns, last_turn=turn_index == max_turns - 1)
        still_running = []
        for trajectory, (turn_ids, ended), result in zip(running, appended, results, strict=True):
            began = time.perf_counter()
            if _answer_turn(trajectory, turn_ids, ended, result, max_episode_tokens):
                still_running.append(trajectory)
            trajectory.record.environment_seconds += time.perf_counter() - began
        environment_seconds += time.perf_counter() - turn_began
        running = still_running
    return environment_seconds


def _append_turn(
    trajectory: _Trajectory,
    turns: BatchedDataDict,
    position: int,
    room: int,
    max_length: int,
    turn_ends: set[int],
    return_logprobs: bool,
) -> tuple[list[int], bool]:
    """Appends the student's turn at ``position`` of the engine's answer; returns its ids and whether it ended.

    The turn ends at the template's end of turn even where the engine did not stop, and is cut at ``room``.
    """
    start, end = int(turns["prompt_lengths"][position]), int(turns["input_lengths"][position])
    turn_ids = turns["input_ids"][position, start:end].tolist()
    turn_logprobs = (
        turns["generation_logprobs"][position, start:end].tolist() if return_logprobs else [0.0] * len(turn_ids)
    )
    ended = not bool(turns["truncated"][position])
    cut = next((at + 1 for at, token in enumerate(turn_ids) if token in turn_ends), None)
    if cut is not None:
        turn_ids, turn_logprobs, ended = turn_ids[:cut], turn_logprobs[:cut], True
    if len(turn_ids) > room:  # another row's room was larger: this turn stops at its own
        turn_ids, turn_logprobs, ended = turn_ids[:room], turn_logprobs[:room], False
    record = trajectory.record
    record.capped = not ended and room < max_length and len(turn_ids) >= room
    trajectory.turn_spans.append((len(trajectory.ids), len(trajectory.ids) + len(turn_ids)))
    trajectory.ids += turn_ids
    trajectory.mask += [1.0] * len(turn_ids)
    trajectory.logprobs += turn_logprobs
    record.turns += 1
    return turn_ids, ended


def _step_episodes(
    environment: Environment, running: list[_Trajectory], turns: list[StudentTurn], last_turn: bool
) -> list[StepResult]:
    """Each running episode's answer to its turn, ``environment.parallelism`` episodes at a time (each one's time
    added to its record)."""

    def step(trajectory: _Trajectory, turn: StudentTurn) -> StepResult:
        began = time.perf_counter()
        result = trajectory.episode.step(turn, last_turn=last_turn)
        trajectory.record.environment_seconds += time.perf_counter() - began
        return result

    workers = min(environment.parallelism, len(running))
    if workers <= 1:
        return [step(trajectory, turn) for trajectory, turn in zip(running, turns, strict=True)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="episode") as pool:
        return list(pool.map(step, running, turns))


def _answer_turn(
    trajectory: _Trajectory,
    turn_ids: list[int],
    ended: bool,
    result: StepResult,
    max_episode_tokens: int | None,
) -> bool:
    """Appends the environment's observation (``result``) after the turn just appended; False when the episode ends
    instead."""
    template, record = trajectory.template, trajectory.record
    tokenizer = template.tokenizer
    record.tool_calls += result.tool_calls
    record.well_formed_calls += result.well_formed_calls
    record.successful_calls += result.successful_calls
    if result.done or not result.observation:
        record.reward, record.truncated = result.reward, not ended
        return False
    record.turn_rewards.append(result.reward)
    turn_end = tokenizer.decode(turn_ids[-1:]) if ended else ""
    observation = template.observation_ids(trajectory.history, turn_end, result.observation)
    if len(observation) >= _room(trajectory, max_episode_tokens):  # no room for a token after it
        record.reward, record.capped = trajectory.episode.stop(), True
        return False
    content = tokenizer.decode(turn_ids[:-1] if ended else turn_ids)
    trajectory.history += [{"role": "assistant", "content": content}, *result.observation]
    trajectory.answered.append((content, list(result.observation)))
    trajectory.ids += observation
    trajectory.mask += [0.0] * len(observation)
    trajectory.logprobs += [0.0] * len(observation)
    return True


def _room(trajectory: _Trajectory, max_episode_tokens: int | None) -> int:
    """Tokens the trajectory may still grow by (without a cap: more than any turn takes)."""
    if max_episode_tokens is None:
        return 2**62
    return max_episode_tokens - len(trajectory.prompt_ids) - len(trajectory.ids)


def _batch(trajectories: list[_Trajectory], pad_token_id: int, with_logprobs: bool) -> BatchedDataDict:
    """The trajectories as right-padded rows, with the student's tokens in ``token_mask``."""
    batch = build_rollout_batch(
        [trajectory.prompt_ids for trajectory in trajectories],
        [trajectory.ids for trajectory in trajectories],
        [trajectory.logprobs for trajectory in trajectories] if with_logprobs else None,
        [trajectory.record.truncated for trajectory in trajectories],
        pad_token_id,
    )
    token_mask = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for row, trajectory in enumerate(trajectories):
        start = len(trajectory.prompt_ids)
        token_mask[row, start : start + len(trajectory.mask)] = torch.tensor(trajectory.mask, dtype=torch.float32)
    batch["token_mask"] = token_mask
    batch["episode_layout"] = [_layout(trajectory) for trajectory in trajectories]
    return batch


EpisodeLayout = dict[str, Any]
"""One row's episode, for whoever re-renders it: ``prompt_messages``; ``turns``, each student turn's ``[start, end)``
in the response (after the prompt); ``contents``, the assistant message each answered turn became, and
``observations``, the messages that answered it (one per turn but the last); ``tools``, the tools' schemas listed."""


def _layout(trajectory: _Trajectory) -> EpisodeLayout:
    messages_after_prompt = sum(1 + len(observation) for _, observation in trajectory.answered)
    return {
        "prompt_messages": trajectory.history[: len(trajectory.history) - messages_after_prompt],
        "turns": [list(span) for span in trajectory.turn_spans],
        "contents": [content for content, _ in trajectory.answered],
        "observations": [observation for _, observation in trajectory.answered],
        "tools": trajectory.template.tools,
    }
