"""Multi-turn rollouts: the student's turns and an environment's answers, up to ``max_turns``.

Built on :meth:`GenerationInterface.generate` alone, so every engine that samples a
single-turn rollout (the in-process HF loop, vLLM, a pool of rollout workers) samples
multi-turn ones too. Each turn is one ``generate`` call over the episodes still running,
with the whole trajectory so far as the prompt; the engine stops each turn at its stop
tokens (for a chat model, the end-of-turn token), and a turn that reaches
``strategy.max_length`` tokens without one is cut there and ends its episode.

The trajectory's ids are the prompt, then each turn's ids as generated, then each
observation tokenised once (:class:`~opd.environments.turn_template.TurnTemplate`), and
so on: nothing is ever re-tokenised, so the teacher scores exactly the ids the student
sampled. The result is the batch a single-turn rollout gives (``input_ids``,
``input_lengths``, ``prompt_lengths``, ``response_lengths``, ``generation_logprobs``,
``truncated``) where the "response" is everything after the prompt, plus ``token_mask``:
1 on the student's own tokens (each turn's stop token included), 0 on the prompt, the
observations (tool outputs and the template's markup between turns) and padding. The
sampler's log-probs are 0 wherever the mask is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.environments.base import Environment, Episode, StudentTurn
from opd.environments.turn_template import TurnTemplate
from opd.models.generation.config import GenerateStrategyConfig
from opd.models.generation.rollout_batch import build_rollout_batch
from opd.models.interfaces import GenerationInterface


@dataclass
class EpisodeRecord:
    """What one episode did (its metrics).

    Attributes:
        turns: student turns generated.
        tool_calls: calls made, over all turns.
        well_formed_calls: calls that parsed.
        successful_calls: calls whose tool ran within its limits.
        environment_seconds: time spent in the environment's steps (tools, grading) and
            in rendering observations.
        reward: the final reward (None: the environment gave none).
        truncated: the last turn was cut at the turn's length limit.
    """

    turns: int = 0
    tool_calls: int = 0
    well_formed_calls: int = 0
    successful_calls: int = 0
    environment_seconds: float = 0.0
    reward: float | None = None
    truncated: bool = False


@dataclass
class _Trajectory:
    """One episode while it runs."""

    prompt_ids: list[int]
    history: list[dict[str, Any]]
    episode: Episode
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    record: EpisodeRecord = field(default_factory=EpisodeRecord)


@dataclass
class MultiTurnRollout:
    """A multi-turn rollout: the training batch and each episode's record (rows in the same order).

    Attributes:
        batch: see the module docstring.
        episodes: one record per row.
    """

    batch: BatchedDataDict
    episodes: list[EpisodeRecord]

    def rewards(self) -> torch.Tensor:
        """``[N]`` float32 final rewards (NaN where an episode has none)."""
        return torch.tensor(
            [math.nan if record.reward is None else record.reward for record in self.episodes], dtype=torch.float32
        )

    def metrics(self) -> dict[str, float]:
        """Means over the episodes, and the environment's total time.

        ``env/turns`` and ``env/tool_calls`` per episode; ``env/well_formed_share`` and
        ``env/success_share`` of all calls (absent without calls); ``env/reward`` over the
        episodes with a reward (absent without); ``timing/environment`` in seconds.
        """
        count = max(len(self.episodes), 1)
        calls = sum(record.tool_calls for record in self.episodes)
        metrics = {
            "env/turns": sum(record.turns for record in self.episodes) / count,
            "env/tool_calls": calls / count,
            "timing/environment": sum(record.environment_seconds for record in self.episodes),
        }
        if calls:
            metrics["env/well_formed_share"] = sum(record.well_formed_calls for record in self.episodes) / calls
            metrics["env/success_share"] = sum(record.successful_calls for record in self.episodes) / calls
        rewards = [record.reward for record in self.episodes if record.reward is not None]
        if rewards:
            metrics["env/reward"] = sum(rewards) / len(rewards)
        return metrics


def multi_turn_rollout(
    generation: GenerationInterface,
    environment: Environment,
    template: TurnTemplate,
    rows: Sequence[Mapping[str, Any]],
    prompt_messages: Sequence[list[dict[str, Any]]],
    strategy: GenerateStrategyConfig,
    max_turns: int,
    pad_token_id: int,
    num_samples: int = 1,
    return_logprobs: bool = True,
) -> MultiTurnRollout:
    """Runs ``num_samples`` episodes per row, turn by turn, and lays them out as a training batch.

    The engine must be switched on (:meth:`GenerationInterface.prepare_for_generation`)
    by the caller, as for ``generate``.

    Args:
        generation: samples each turn.
        environment: starts an episode per sample and answers each turn.
        template: renders the prompts (with the environment's tools) and the observations.
        rows: the dataset rows the episodes start from.
        prompt_messages: each row's prompt conversation (up to the first assistant turn).
        strategy: sampling of each turn (``max_length``: new tokens per turn).
        max_turns: most student turns per episode (>= 1).
        pad_token_id: fills rows past their length.
        num_samples: episodes per row (adjacent in the batch).
        return_logprobs: ask the engine for the sampler's log-probs.

    Returns:
        The batch and the episodes' records; see the module docstring.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if len(rows) != len(prompt_messages):
        raise ValueError(f"{len(rows)} rows but {len(prompt_messages)} prompt conversations")
    tokenizer = template.tokenizer
    trajectories = []
    for row, messages in zip(rows, prompt_messages):
        prompt_ids = template.prompt_ids(messages)
        for _ in range(num_samples):
            trajectories.append(_Trajectory(prompt_ids, list(messages), environment.start(row)))
    running = list(range(len(trajectories)))
    for turn_index in range(max_turns):
        if not running:
            break
        turns = generation.generate(
            [trajectories[index].prompt_ids + trajectories[index].ids for index in running],
            strategy,
            num_samples=1,
            return_logprobs=return_logprobs,
        )
        still_running = []
        for position, index in enumerate(running):
            trajectory = trajectories[index]
            start, end = int(turns["prompt_lengths"][position]), int(turns["input_lengths"][position])
            turn_ids = turns["input_ids"][position, start:end].tolist()
            trajectory.ids += turn_ids
            trajectory.mask += [1.0] * len(turn_ids)
            trajectory.logprobs += (
                turns["generation_logprobs"][position, start:end].tolist() if return_logprobs else [0.0] * len(turn_ids)
            )
            ended = not bool(turns["truncated"][position])
            record = trajectory.record
            record.turns += 1
            began = time.perf_counter()
            turn = StudentTurn(tokenizer.decode(turn_ids, skip_special_tokens=True), tuple(turn_ids), ended)
            result = trajectory.episode.step(turn, last_turn=turn_index == max_turns - 1)
            record.tool_calls += result.tool_calls
            record.well_formed_calls += result.well_formed_calls
            record.successful_calls += result.successful_calls
            if result.done or not result.observation:
                record.reward, record.truncated = result.reward, not ended
            else:
                turn_end = tokenizer.decode(turn_ids[-1:]) if ended else ""
                observation = template.observation_ids(trajectory.history, turn_end, result.observation)
                content = tokenizer.decode(turn_ids[:-1] if ended else turn_ids)
                trajectory.history += [{"role": "assistant", "content": content}, *result.observation]
                trajectory.ids += observation
                trajectory.mask += [0.0] * len(observation)
                trajectory.logprobs += [0.0] * len(observation)
                still_running.append(index)
            record.environment_seconds += time.perf_counter() - began
        running = still_running
    return MultiTurnRollout(_batch(trajectories, pad_token_id, return_logprobs), [t.record for t in trajectories])


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
    return batch
