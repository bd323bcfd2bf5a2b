"""Sampling sanity: no run pays for identical samples without knowing it.

* greedy decoding with several samples per prompt is a config error that names both keys;
* ``unique_responses_per_prompt`` counts distinct responses per prompt group, against a
  plain Python count on hand-made batches;
* an on-policy run logs ``train/unique_responses_per_prompt`` (between 1 and the number
  of samples; fixed-data steps do not log it);
* ``distillation_math.yaml`` itself validates and samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.batches import unique_responses_per_prompt
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
MATH_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_math.yaml"


def test_greedy_with_several_samples_is_refused():
    with pytest.raises(ConfigError) as error:
        load_config(
            MasterConfig,
            TINY_CONFIG,
            ["distillation.num_samples_per_prompt=4", "distillation.generate_strategy.decoding_method=greedy"],
        )
    message = str(error.value)
    assert "num_samples_per_prompt = 4" in message and "decoding_method = greedy" in message
    # One greedy sample, or several sampled ones, are fine.
    load_config(MasterConfig, TINY_CONFIG, ["distillation.num_samples_per_prompt=1",
                                            "distillation.generate_strategy.decoding_method=greedy"])
    load_config(MasterConfig, TINY_CONFIG, ["distillation.num_samples_per_prompt=4",
                                            "distillation.generate_strategy.decoding_method=top_k"])


def test_the_math_config_samples_differing_answers():
    config = load_config(MasterConfig, MATH_CONFIG, [])
    assert config.distillation.num_samples_per_prompt > 1
    assert config.distillation.generate_strategy.decoding_method != "greedy"
    assert config.distillation.generate_strategy.temperature == 0.1  # the specification's default


def batch_of(prompt_lengths: list[int], responses: list[list[int]]) -> BatchedDataDict:
    width = max(p + len(r) for p, r in zip(prompt_lengths, responses)) + 2
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    for row, (prompt_length, response) in enumerate(zip(prompt_lengths, responses)):
        ids[row, :prompt_length] = 5  # prompts differ in length only; responses follow them
        ids[row, prompt_length : prompt_length + len(response)] = torch.tensor(response, dtype=torch.long)
    return BatchedDataDict(
        {
            "input_ids": ids,
            "prompt_lengths": torch.tensor(prompt_lengths),
            "input_lengths": torch.tensor([p + len(r) for p, r in zip(prompt_lengths, responses)]),
        }
    )


@pytest.mark.parametrize("seed", range(5))
def test_unique_responses_per_prompt_matches_a_plain_count(seed):
    generator = torch.Generator().manual_seed(seed)
    samples, prompts = 3, 4
    prompt_lengths, responses = [], []
    for _ in range(prompts):
        length = int(torch.randint(2, 6, (1,), generator=generator))
        for _ in range(samples):
            # Few short responses over a tiny alphabet: copies happen often.
            size = int(torch.randint(0, 3, (1,), generator=generator))
            responses.append(torch.randint(1, 3, (size,), generator=generator).tolist())
            prompt_lengths.append(length)
    expected = sum(
        len({tuple(r) for r in responses[start : start + samples]}) for start in range(0, len(responses), samples)
    ) / prompts
    assert unique_responses_per_prompt(batch_of(prompt_lengths, responses), samples) == pytest.approx(expected)


def test_unique_responses_edge_cases():
    same = batch_of([3, 3], [[1, 2], [1, 2]])
    assert unique_responses_per_prompt(same, 2) == 1.0
    # A response that equals another's prefix differs from it; empty responses count once.
    assert unique_responses_per_prompt(batch_of([3, 3], [[1, 2], [1]]), 2) == 2.0
    assert unique_responses_per_prompt(batch_of([3, 3], [[], []]), 2) == 1.0
    assert unique_responses_per_prompt(batch_of([3, 4], [[1], [1]]), 1) == 1.0


def test_an_on_policy_run_logs_unique_responses(tmp_path):
    config = load_config(
        MasterConfig,
        TINY_CONFIG,
        [
            *short_run_overrides(tmp_path),
            "checkpointing.enabled=false",
            "training.batch_size=2",
            "training.micro_batch_size=null",
            "training.max_num_steps=4",
            "distillation.lambda=0.5",
            "distillation.num_samples_per_prompt=3",
            "distillation.generate_strategy.max_length=8",
        ],
    )
    # λ = 0.5 needs fixed answers: the tiny data has them.
    distillation_train(setup(config))
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/on_policy" in record]
    assert {record["train/on_policy"] for record in steps} == {0, 1}, "want both kinds of step (seeded coin)"
    for record in steps:
        if record["train/on_policy"]:
            assert 1.0 <= record["train/unique_responses_per_prompt"] <= 3.0
        else:
            assert "train/unique_responses_per_prompt" not in record
