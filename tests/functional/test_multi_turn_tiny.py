"""Multi-turn rollouts through the real in-process HF engine, scored by a real tiny teacher, trained on.

Tiny models (``opd.models.tiny``) and the byte-level tiny tokenizer; an environment that
answers every student turn with a user message until ``max_turns``. The engine stops a
turn at the tokens it emitted third in a first greedy pass, so every episode has short
turns that end at a stop token and observations in between.

* The sampler's log-probs of every student token equal the student's own log-probs from
  one forward pass over the finished trajectory: each turn was generated in exactly the
  context the trajectory holds (nothing re-tokenised, nothing lost between turns).
* The teacher's answer for the trajectory batch (right-padded, and packed) equals the
  teacher run once on the conversation's whole text, tokenised at once.
* Every loss reads the mask with its holes: changing the teacher's signal, the sampler's
  log-probs or the ids' predictions at observation positions changes neither the loss nor
  its gradient, and the packed batch gives the unpacked loss.
"""

from __future__ import annotations

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import encode_text, model_inputs, pack_padding_free
from opd.losses.distillation_losses import KLLossFn
from opd.losses.off_policy import OffPolicyCorrection, OffPolicyCorrectionConfig
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import FullVocabRequest, TokenLogprobsRequest, TopKRequest
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.rollout.environments.base import Environment, Episode, StepResult, StudentTurn
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.multi_turn import multi_turn_rollout
from opd.teachers.local_teacher import LocalTeacher

MAX_TURNS = 3
STRATEGY = GenerateStrategyConfig(max_length=6, decoding_method="greedy")
ROWS = [
    {"messages": [{"role": "user", "content": "Add 2 and 3."}]},
    {"messages": [{"role": "user", "content": "Count to four, slowly."}]},
]


class _GoOn(Environment):
    """A simulated user who says "go on" after every turn (the episode ends at ``max_turns``)."""

    class _Episode(Episode):
        def step(self, turn: StudentTurn, last_turn: bool = False) -> StepResult:
            if last_turn or not turn.ended:
                return StepResult(done=True, reward=float(len(turn.token_ids)))
            return StepResult([{"role": "user", "content": "go on"}])

    def start(self, row):
        return self._Episode()


@pytest.fixture(scope="module")
def rollout_and_models():
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    student, teacher = build_tiny_model("student"), build_tiny_model("teacher")
    template = TurnTemplate(tokenizer)
    probe = HFGeneration(student, tokenizer)
    probe.prepare_for_generation()
    first = probe.generate([template.prompt_ids(row["messages"]) for row in ROWS], STRATEGY)
    stops = {int(first["input_ids"][row, int(first["prompt_lengths"][row]) + 2]) for row in range(len(ROWS))}
    engine = HFGeneration(student, tokenizer, stop_ids=sorted(stops | {tokenizer.eos_token_id}))
    engine.prepare_for_generation()
    rollout = multi_turn_rollout(
        engine, _GoOn(), template, ROWS, [row["messages"] for row in ROWS], STRATEGY, MAX_TURNS, tokenizer.pad_token_id
    )
    engine.finish_generation()
    return rollout, tokenizer, student, teacher


def test_rollout_has_turns_and_holes(rollout_and_models):
    rollout, *_ = rollout_and_models
    batch = rollout.batch
    assert all(record.turns >= 2 for record in rollout.episodes)
    for row in range(batch.size):
        start, end = int(batch["prompt_lengths"][row]), int(batch["input_lengths"][row])
        mask = batch["token_mask"][row]
        assert mask[:start].sum() == 0 and mask[end:].sum() == 0
        response = mask[start:end]
        changes = int((response[1:] != response[:-1]).sum())
        assert changes >= 2, "the student's turns are separated by observation tokens that carry no loss"
        assert torch.equal(batch["generation_logprobs"][row] != 0, mask.bool())
    assert int(batch["response_lengths"].sum()) == int((batch["input_lengths"] - batch["prompt_lengths"]).sum())


def test_sampler_logprobs_equal_one_pass_over_the_trajectory(rollout_and_models):
    rollout, _, student, _ = rollout_and_models
    batch = rollout.batch
    for row in range(batch.size):
        length = int(batch["input_lengths"][row])
        ids = batch["input_ids"][row, :length].unsqueeze(0)
        with torch.no_grad():
            logprobs = torch.log_softmax(student(input_ids=ids).logits[0, :-1].float(), dim=-1)
        own = logprobs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        mask = batch["token_mask"][row, 1:length].bool()
        torch.testing.assert_close(batch["generation_logprobs"][row, 1:length][mask], own[mask], rtol=1e-5, atol=1e-5)


def test_teacher_scores_the_trajectory_as_the_whole_text_in_one_pass(rollout_and_models):
    rollout, tokenizer, _, teacher_model = rollout_and_models
    batch, teacher = rollout.batch, LocalTeacher(teacher_model)
    logits = teacher.score(batch, FullVocabRequest())
    topk_logprobs, topk_ids = teacher.score(batch, TopKRequest(k=4))
    token_logprobs = teacher.score(batch, TokenLogprobsRequest())
    packed = pack_padding_free(batch)
    packed_logits = teacher.score(packed, FullVocabRequest())
    offset = 0
    for row in range(batch.size):
        length = int(batch["input_lengths"][row])
        text = tokenizer.decode(batch["input_ids"][row, :length])
        ids = torch.tensor([encode_text(tokenizer, text)])
        assert ids[0].tolist() == batch["input_ids"][row, :length].tolist()
        with torch.no_grad():
            whole = teacher_model(input_ids=ids).logits[0].float()
        torch.testing.assert_close(logits[row, :length].float(), whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed_logits[0, offset : offset + length].float(), whole, rtol=1e-5, atol=1e-5)
        best = torch.log_softmax(whole, dim=-1).topk(4, dim=-1)
        torch.testing.assert_close(topk_logprobs[row, :length], best.values, rtol=1e-5, atol=1e-5)
        assert torch.equal(topk_ids[row, :length], best.indices)
        own = torch.log_softmax(whole[:-1], dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(token_logprobs[row, 1:length], own, rtol=1e-5, atol=1e-5)
        offset += length


def _loss_and_grad(loss_fn, batch, student, teacher_output):
    student.zero_grad()
    logits = student(**model_inputs(batch, "cpu"), use_cache=False).logits  # packed rows need no cache
    tokens = int(batch["token_mask"][:, 1:].sum())
    loss, _ = loss_fn(logits, batch, tokens, batch.size, teacher_output)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]).clone()
    return float(loss.detach()), grad


def _outside(batch) -> torch.Tensor:
    """``[B, L]`` True at logit positions whose next token carries no loss (prompt, observations, padding)."""
    holes = torch.ones_like(batch["token_mask"], dtype=torch.bool)
    holes[:, :-1] = batch["token_mask"][:, 1:] == 0
    return holes


def test_full_vocab_loss_reads_only_the_students_tokens(rollout_and_models):
    rollout, _, student, teacher_model = rollout_and_models
    batch = rollout.batch
    teacher = LocalTeacher(teacher_model)
    logits = teacher.score(batch, FullVocabRequest()).float()
    loss_fn = KLLossFn(kl_type="forward")
    loss, grad = _loss_and_grad(loss_fn, batch, student, logits)
    scrambled = torch.where(_outside(batch).unsqueeze(-1), torch.randn_like(logits) * 5, logits)
    other_loss, other_grad = _loss_and_grad(loss_fn, batch, student, scrambled)
    assert other_loss == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(other_grad, grad, rtol=1e-5, atol=1e-7)
    # Reference: forward KL summed over the student's tokens only, divided by their count.
    with torch.no_grad():
        student_logits = student(input_ids=batch["input_ids"], attention_mask=(batch["token_mask"] >= 0).long())
    mask = batch["token_mask"][:, 1:].bool()
    p = torch.log_softmax(logits[:, :-1][mask], -1)
    q = torch.log_softmax(student_logits.logits[:, :-1][mask].float(), -1)
    reference = float((p.exp() * (p - q)).sum() / mask.sum())
    assert loss == pytest.approx(reference, rel=1e-4)
    packed = pack_padding_free(batch)
    packed_loss, packed_grad = _loss_and_grad(loss_fn, packed, student, teacher.score(packed, FullVocabRequest()))
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(packed_grad, grad, rtol=1e-4, atol=1e-6)


def test_sampled_token_and_off_policy_weights_read_only_the_students_tokens(rollout_and_models):
    rollout, _, student, teacher_model = rollout_and_models
    batch = BatchedDataDict(rollout.batch)
    batch["staleness"] = torch.ones(batch.size, dtype=torch.long)  # weighed as stale samples
    teacher_logprobs = LocalTeacher(teacher_model).score(batch, TokenLogprobsRequest())
    correction = OffPolicyCorrection.from_config(OffPolicyCorrectionConfig(sequence_bounds=(0.5, 2.0)), STRATEGY)
    for loss_fn, signal in (
        (SampledTokenLossFn(), teacher_logprobs),
        (
            KLLossFn(kl_type="reverse", off_policy=correction),
            LocalTeacher(teacher_model).score(batch, FullVocabRequest()),
        ),
    ):
        loss, grad = _loss_and_grad(loss_fn, batch, student, signal)
        changed = BatchedDataDict(batch)
        # Sampler (and teacher token) log-probs at observation tokens must not matter.
        token_holes = batch["token_mask"] == 0
        changed["generation_logprobs"] = torch.where(
            token_holes, torch.full_like(batch["generation_logprobs"], -30.0), batch["generation_logprobs"]
        )
        if signal.dim() == 2:
            signal = torch.where(token_holes, torch.full_like(signal, -30.0), signal)
        other_loss, other_grad = _loss_and_grad(loss_fn, changed, student, signal)
        assert other_loss == pytest.approx(loss, rel=1e-6)
        torch.testing.assert_close(other_grad, grad, rtol=1e-5, atol=1e-7)
