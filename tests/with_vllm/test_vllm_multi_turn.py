"""Multi-turn rollouts with the vLLM engine equal the HF engine's, token for token (greedy).

A multi-turn rollout (:func:`opd.rollout.multi_turn.multi_turn_rollout`) is built on
``GenerationInterface.generate`` alone, so vLLM samples it as it samples a single turn:
each turn is one call with the whole trajectory so far as the prompt. The tiny demo-shaped
student and the tiny tokenizer, an environment that answers every turn with a user message
(``tests/functional/test_multi_turn_tiny.py``'s), and stop tokens that end each turn
after a few tokens: both engines must give the same trajectory ids, the same
``token_mask`` (observations are holes), the same turns per episode, and sampler
log-probs that agree within 1e-4 on the student's tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")

import torch
from functional.test_multi_turn_tiny import MAX_TURNS, ROWS, STRATEGY, _GoOn

from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.multi_turn import multi_turn_rollout
from opd.rollout.vllm_generation import VllmGeneration, VllmGenerationConfig


def rollout_with(engine, template, tokenizer):
    engine.prepare_for_generation()
    try:
        return multi_turn_rollout(
            engine, _GoOn(), template, ROWS, [row["messages"] for row in ROWS], STRATEGY, MAX_TURNS,
            tokenizer.pad_token_id,
        )
    finally:
        engine.finish_generation()


def test_vllm_multi_turn_rollouts_equal_the_hf_engines():
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    student = build_tiny_model("demo-student")  # vLLM's CPU attention needs its head size (64)
    template = TurnTemplate(tokenizer)
    probe = HFGeneration(student, tokenizer)
    probe.prepare_for_generation()
    first = probe.generate([template.prompt_ids(row["messages"]) for row in ROWS], STRATEGY)
    # Each turn ends at a token the student emits early, so episodes have several turns.
    stops = sorted({int(first["input_ids"][row, int(first["prompt_lengths"][row]) + 2]) for row in range(len(ROWS))}
                   | {tokenizer.eos_token_id})
    expected = rollout_with(HFGeneration(student, tokenizer, stop_ids=stops), template, tokenizer)
    vllm_engine = VllmGeneration(student, tokenizer, VllmGenerationConfig(dtype="float32"), seed=0, stop_ids=stops)
    try:
        actual = rollout_with(vllm_engine, template, tokenizer)
    finally:
        vllm_engine.close()
    assert [record.turns for record in actual.episodes] == [record.turns for record in expected.episodes]
    assert all(record.turns >= 2 for record in expected.episodes)  # observations between turns
    for key in ("input_lengths", "prompt_lengths", "response_lengths"):
        assert actual.batch[key].tolist() == expected.batch[key].tolist(), key
    for row, length in enumerate(expected.batch["input_lengths"].tolist()):
        assert actual.batch["input_ids"][row, :length].tolist() == expected.batch["input_ids"][row, :length].tolist()
        assert torch.equal(actual.batch["token_mask"][row, :length], expected.batch["token_mask"][row, :length])
        student_tokens = expected.batch["token_mask"][row, :length].bool()
        torch.testing.assert_close(
            actual.batch["generation_logprobs"][row, :length][student_tokens],
            expected.batch["generation_logprobs"][row, :length][student_tokens],
            rtol=0, atol=1e-4,
        )
