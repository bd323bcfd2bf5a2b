"""Per-turn rewards: an environment rewards each turn, and every student token gets its turn's return.

The return of turn k is the sum of the rewards of turns k, k+1, ... and the final reward, computed here in float64
from the token mask's runs (one run of student tokens per turn), independently of the rollout's bookkeeping.
"""

from __future__ import annotations

import random

import pytest
import torch
from opd_scripted_engine import ScriptedGeneration

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_padding_free
from opd.losses.sampled_token import sampled_token_advantages
from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_tokenizer
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.multi_turn import EpisodeRecord, multi_turn_rollout
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import ToolRegistry

GOOD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
BAD = "<tool_call>\n{not json\n</tool_call>"
END = "<|im_end|>"
ROW = {"messages": [{"role": "user", "content": "What is 6 * 7?"}], "ground_truth": "42"}


def _reference_returns(turn_rewards: list[float | None], final: float | None, turns: int) -> list[float]:
    rewards = [float(reward or 0.0) for reward in turn_rewards] + [float(final or 0.0)]
    return [float(sum(rewards[k:])) for k in range(len(rewards))][:turns]


def test_returns_match_a_float64_reference_on_random_rewards():
    generator = random.Random(0)
    for _ in range(200):
        turns = generator.randint(1, 6)
        turn_rewards = [generator.choice([None, generator.uniform(-2, 2)]) for _ in range(turns - 1)]
        final = generator.choice([None, generator.uniform(-1, 1)])
        record = EpisodeRecord(turns=turns, reward=final, turn_rewards=turn_rewards)
        assert record.returns() == pytest.approx(_reference_returns(turn_rewards, final, turns), abs=1e-12)


def test_an_episode_capped_after_a_rewarded_turn_adds_the_final_reward_to_that_turn():
    record = EpisodeRecord(turns=2, reward=1.0, turn_rewards=[-0.5, -0.25])  # the second turn's observation capped
    assert record.returns() == [0.25, 0.75]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _rollout(tokenizer, turns: list[str], failed_call_reward: float, num_samples: int = 1):
    environment = ToolEnvironment(ToolRegistry([calculator_tool()]), failed_call_reward=failed_call_reward)
    return multi_turn_rollout(
        ScriptedGeneration(tokenizer, turns, stop_ids=(tokenizer.convert_tokens_to_ids(END),)),
        environment,
        TurnTemplate(tokenizer, environment.tool_schemas()),
        [ROW, {"ground_truth": "41"}],
        [ROW["messages"], ROW["messages"]],
        GenerateStrategyConfig(max_length=400),
        max_turns=3,
        pad_token_id=tokenizer.pad_token_id,
        num_samples=num_samples,
    )


def _turn_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of 1s in a row's token mask: one per student turn."""
    runs, start = [], None
    for position, value in enumerate([*mask.tolist(), 0.0]):
        if value == 1.0 and start is None:
            start = position
        elif value != 1.0 and start is not None:
            runs.append((start, position))
            start = None
    return runs


def test_each_student_token_gets_its_turns_return(tokenizer):
    turns = [GOOD + BAD + BAD + END, GOOD + END, "The answer is \\boxed{42}" + END]
    rollout = _rollout(tokenizer, turns, failed_call_reward=-0.25)
    assert [record.turn_rewards for record in rollout.episodes] == [[-0.5, 0.0], [-0.5, 0.0]]
    assert [record.reward for record in rollout.episodes] == [1.0, 0.0]  # the second row's truth is 41
    rewards = rollout.task_rewards()
    assert rewards.shape == rollout.batch["input_ids"].shape and rewards.dtype == torch.float32
    for row, record in enumerate(rollout.episodes):
        mask = rollout.batch["token_mask"][row]
        runs = _turn_runs(mask)
        expected = _reference_returns(record.turn_rewards, record.reward, record.turns)
        assert len(runs) == 3 == len(expected)
        for (start, end), value in zip(runs, expected, strict=True):
            assert torch.equal(rewards[row, start:end], torch.full((end - start,), value, dtype=torch.float32))
        assert torch.all(rewards[row][mask == 0] == 0)
    assert rollout.metrics()["env/turn_reward"] == pytest.approx(-0.25)


def test_without_turn_rewards_the_task_reward_is_the_final_reward_per_row(tokenizer):
    rollout = _rollout(tokenizer, [GOOD + BAD + END, "\\boxed{42}" + END], failed_call_reward=0.0, num_samples=2)
    assert all(record.turn_rewards == [None] for record in rollout.episodes)
    assert torch.equal(rollout.task_rewards(), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert "env/turn_reward" not in rollout.metrics()


def test_packing_keeps_per_token_rewards_in_place(tokenizer):
    rollout = _rollout(tokenizer, [GOOD + BAD + END, "\\boxed{42}" + END], failed_call_reward=-1.0)
    batch = BatchedDataDict(rollout.batch)
    batch["task_reward"] = rollout.task_rewards()
    packed = pack_padding_free(batch)
    lengths = batch["input_lengths"].tolist()
    expected = torch.cat([batch["task_reward"][row, :length] for row, length in enumerate(lengths)])
    assert torch.equal(packed["task_reward"][0], expected)
    assert packed["task_reward"].shape == packed["input_ids"].shape


def test_the_sampled_token_advantage_adds_each_tokens_own_return():
    generator = torch.Generator().manual_seed(3)
    student, teacher = (torch.randn(2, 6, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0]], dtype=torch.float64)
    returns = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    advantages = sampled_token_advantages(student, teacher, mask, 0.7, 1.3, task_reward=returns, adv_tau=0.5)
    expected = (0.7 * teacher - 1.3 * student + 0.5 * returns) * mask
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
