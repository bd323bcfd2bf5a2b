"""A tensor-parallel vLLM engine (``generation.vllm.tensor_parallel_size: 2``) against the HF backend.

vLLM's CPU build runs tensor parallel over two processes that it spawns (its
multiprocessing executor); each holds half of every sharded weight. The engine starts from
dummy weights and is refit from the student in memory, as the one-device engine is, so the
checks are the same: greedy rollouts equal the HF backend's token for token, and after a
training step and a refit they equal the updated student's.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")

import torch
from with_vllm.test_vllm_generation import (
    assert_same_rollouts,
    greedy,
    one_training_step,
    prompts,  # noqa: F401 - a fixture
    student,  # noqa: F401 - a fixture
    tokenizer,  # noqa: F401 - a fixture
)

from opd.rollout.hf_generation import HFGeneration
from opd.rollout.vllm_generation import VllmGeneration, VllmGenerationConfig


@pytest.fixture(scope="module")
def parallel_engine(student, tokenizer):  # noqa: F811 - the imported fixtures
    generation = VllmGeneration(student, tokenizer, VllmGenerationConfig(tensor_parallel_size=2), seed=0)
    yield generation
    generation.close()


def test_two_way_tensor_parallel_rollouts_and_refit_equal_the_hf_backend(
    parallel_engine, student, tokenizer, prompts  # noqa: F811 - the imported fixtures
):
    assert parallel_engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    hf_batch = HFGeneration(student, tokenizer).generate(prompts, greedy(48))
    assert_same_rollouts(parallel_engine.generate(prompts, greedy(48)), hf_batch)

    model = copy.deepcopy(student)
    one_training_step(model, tokenizer, prompts)
    model.eval()
    updated = HFGeneration(model, tokenizer).generate(prompts, greedy(48))
    assert not torch.equal(updated["input_ids"], hf_batch["input_ids"]) or not torch.allclose(
        updated["generation_logprobs"], hf_batch["generation_logprobs"], atol=1e-3
    ), "the step should change what the student writes, else the refit check shows nothing"
    parallel_engine.refit_from_model(model)
    assert_same_rollouts(parallel_engine.generate(prompts, greedy(48)), updated)

