"""``loss_fn.type: hybrid_full_vocab``: seed 003's hybrid with the distillation terms over the vocabulary.

* the value equals a float64 reference (masks with an all-masked row, extreme logits,
  both reductions, per-sequence and packed per-token rewards);
* with both τ = 1 and no reward it is the reverse KL of ``KLLossFn``, value and
  gradient;
* its gradient equals the exact expectation, over the vocabulary, of the sampled-token
  policy gradient ``−A(x) ∇ log q(x)`` with ``A = teacher_tau log p − student_tau log q``;
* the reward term's gradient is ``−adv_tau · r · (e_x − q)`` at each sampled token;
* stale samples (an asynchronous schedule) weigh each position, both terms, by the truncated
  importance weight; fresh samples are exactly the uncorrected loss; a ``one_step_off`` run
  weighs its stale batch;
* a short run with the math verifier's reward trains and logs it; config mistakes name keys.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import KLLossFn
from opd.losses.hybrid_loss import FullVocabHybridLossFn
from opd.losses.off_policy import OffPolicyCorrection
from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import LMHeadInput
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
B, L, V = 3, 7, 11


def inputs(seed: int = 0, scale: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, L, V, generator=generator, dtype=torch.float64) * scale).requires_grad_(True)
    teacher = torch.randn(B, L, V, generator=generator, dtype=torch.float64) * scale
    input_ids = torch.randint(0, V, (B, L), generator=generator)
    token_mask = torch.zeros(B, L)
    token_mask[0, 2:6] = 1.0
    token_mask[1, 1:7] = 1.0  # row 2 stays all-masked
    reward = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    data = {"input_ids": input_ids, "token_mask": token_mask, "task_reward": reward}
    return student, teacher, data


def reference(student, teacher, data, teacher_tau, student_tau, adv_tau, normalizer):
    total = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for t in range(1, L):
            if data["token_mask"][b, t] == 0:
                continue
            log_q = torch.log_softmax(student[b, t - 1], -1)
            log_p = torch.log_softmax(teacher[b, t - 1], -1)
            total = total + (log_q.exp() * (student_tau * log_q - teacher_tau * log_p)).sum()
            reward = data["task_reward"][b] if data["task_reward"].dim() == 1 else data["task_reward"][b, t]
            total = total - adv_tau * reward * log_q[data["input_ids"][b, t]]
    return total / normalizer


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scale", [3.0, 60.0])  # 60: extreme logits, near one-hot distributions
def test_value_equals_the_float64_reference(reduction, scale):
    student, teacher, data = inputs(scale=scale)
    tokens = int(data["token_mask"][:, 1:].sum())
    loss_fn = FullVocabHybridLossFn(teacher_tau=0.7, student_tau=0.4, adv_tau=0.5, kl_reduction=reduction)
    loss, metrics = loss_fn(student, data, tokens, B, teacher_output=teacher)
    normalizer = tokens if reduction == "mean" else B
    expected = reference(student, teacher, data, 0.7, 0.4, 0.5, normalizer)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    assert metrics["num_valid_tokens"] == tokens


def test_per_token_rewards_that_vary_within_a_row_equal_the_float64_reference():
    # A multi-turn rollout's returns: each token its own turn's return (random here, any sign).
    student, teacher, data = inputs()
    data["task_reward"] = torch.randn(B, L, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tokens = int(data["token_mask"][:, 1:].sum())
    loss_fn = FullVocabHybridLossFn(teacher_tau=0.7, student_tau=0.4, adv_tau=0.5)
    loss, _ = loss_fn(student, data, tokens, B, teacher_output=teacher)
    torch.testing.assert_close(loss, reference(student, teacher, data, 0.7, 0.4, 0.5, tokens), rtol=1e-10, atol=1e-12)


def test_packed_per_token_rewards_equal_per_sequence_rewards():
    student, teacher, data = inputs(seed=3)
    tokens = int(data["token_mask"][:, 1:].sum())
    loss_fn = FullVocabHybridLossFn(adv_tau=2.0)
    per_sequence, _ = loss_fn(student, data, tokens, B, teacher_output=teacher)
    per_token = dict(data, task_reward=data["task_reward"].unsqueeze(-1).expand(B, L).clone())
    packed_form, _ = loss_fn(student, per_token, tokens, B, teacher_output=teacher)
    torch.testing.assert_close(packed_form, per_sequence, rtol=0, atol=0)


def test_a_teachers_hidden_states_over_its_head_give_the_loss_of_its_logits():
    """A teacher that runs apart sends hidden states the trainer binds to the teacher's head (issue 35)."""
    student, _, data = inputs(seed=2)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, L, 8, generator=generator, dtype=torch.float64)
    head = torch.randn(V, 8, generator=generator, dtype=torch.float64)
    tokens = int(data["token_mask"][:, 1:].sum())
    loss_fn = FullVocabHybridLossFn(teacher_tau=0.7, adv_tau=0.5)
    from_logits, _ = loss_fn(student, data, tokens, B, teacher_output=hidden @ head.T)
    from_hidden, _ = loss_fn(student, data, tokens, B, teacher_output=LMHeadInput(hidden, head, None))
    torch.testing.assert_close(from_hidden, from_logits, rtol=1e-12, atol=1e-12)


def test_with_unit_taus_and_no_reward_it_is_the_reverse_kl():
    student, teacher, data = inputs(seed=1)
    tokens = int(data["token_mask"][:, 1:].sum())
    hybrid, _ = FullVocabHybridLossFn()(student, data, tokens, B, teacher_output=teacher)
    (hybrid_grad,) = torch.autograd.grad(hybrid, student)
    kl, _ = KLLossFn(kl_type="reverse", fused_lm_head=False, compile_kernels=False)(
        student, data, tokens, B, teacher_output=teacher)
    (kl_grad,) = torch.autograd.grad(kl, student)
    torch.testing.assert_close(hybrid, kl, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hybrid_grad, kl_grad, rtol=1e-9, atol=1e-12)


def test_gradient_is_the_expected_sampled_token_policy_gradient():
    student, teacher, data = inputs(seed=2)
    tokens = int(data["token_mask"][:, 1:].sum())
    teacher_tau, student_tau, adv_tau = 0.8, 0.3, 1.5
    loss, _ = FullVocabHybridLossFn(teacher_tau, student_tau, adv_tau)(student, data, tokens, B,
                                                                       teacher_output=teacher)
    (grad,) = torch.autograd.grad(loss, student)
    expected = torch.zeros_like(grad)
    with torch.no_grad():
        for b in range(B):
            for t in range(1, L):
                if data["token_mask"][b, t] == 0:
                    continue
                log_q = torch.log_softmax(student[b, t - 1], -1)
                q = log_q.exp()
                advantage = teacher_tau * torch.log_softmax(teacher[b, t - 1], -1) - student_tau * log_q
                # E_x~q[-A(x) (e_x - q)] over the whole vocabulary, in closed form:
                expected[b, t - 1] = -(q * advantage - q * (q * advantage).sum())
                # the reward's policy gradient at the sampled token
                onehot = torch.zeros(V, dtype=torch.float64)
                onehot[data["input_ids"][b, t]] = 1.0
                expected[b, t - 1] += -adv_tau * data["task_reward"][b] * (onehot - q)
    torch.testing.assert_close(grad, expected / tokens, rtol=1e-9, atol=1e-12)


def test_an_all_masked_batch_gives_zero():
    student, teacher, data = inputs()
    data["token_mask"].zero_()
    loss, metrics = FullVocabHybridLossFn(adv_tau=1.0)(student, data, 0, B, teacher_output=teacher)
    assert float(loss.detach()) == 0.0 and metrics["num_valid_tokens"] == 0


def test_stale_positions_are_weighted_by_the_truncated_importance_weight():
    """Rows 0 and 2 are stale: each position weighs its exact and reward terms by min(q(x) / q_sampler(x), cap)."""
    student, teacher, data = inputs(scale=1.0)
    generator = torch.Generator().manual_seed(1)
    learner = torch.log_softmax(student.detach(), -1)  # greedy strategy: the plain softmax
    token_logprobs = torch.zeros(B, L, dtype=torch.float64)
    token_logprobs[:, 1:] = learner[:, :-1].gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    # The sampler's log-probs: off by up to ±1.5 nats, so some ratios pass the cap and some fall below 1.
    offsets = torch.rand(B, L, generator=generator, dtype=torch.float64) * 3 - 1.5
    data["generation_logprobs"] = token_logprobs + offsets
    data["staleness"] = torch.tensor([1, 0, 2])
    cap = 1.5
    correction = OffPolicyCorrection(cap, None, None, GenerateStrategyConfig(decoding_method="greedy"))
    tokens = int(data["token_mask"][:, 1:].sum())
    loss_fn = FullVocabHybridLossFn(student_tau=0.5, adv_tau=0.7, off_policy=correction)
    loss, metrics = loss_fn(student, data, tokens, B, teacher_output=teacher)

    expected = torch.zeros((), dtype=torch.float64)
    ratios = []
    for b in range(B):
        for t in range(1, L):
            if data["token_mask"][b, t] == 0:
                continue
            log_q = torch.log_softmax(student[b, t - 1], -1)
            log_p = torch.log_softmax(teacher[b, t - 1], -1)
            token = data["input_ids"][b, t]
            ratio = float(torch.exp(log_q[token].detach() - data["generation_logprobs"][b, t]))
            weight = min(ratio, cap) if data["staleness"][b] > 0 else 1.0
            ratios.append(ratio if data["staleness"][b] > 0 else 1.0)
            term = (log_q.exp() * (0.5 * log_q - log_p)).sum() - 0.7 * data["task_reward"][b] * log_q[token]
            expected = expected + weight * term
    expected = expected / tokens
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)  # the weights are computed in float32
    assert any(ratio > cap for ratio in ratios) and any(ratio < 1 for ratio in ratios)  # the weights matter
    assert metrics["is_ratio_mean"] == pytest.approx(sum(ratios) / tokens, rel=1e-6)
    assert metrics["is_truncated_fraction"] == pytest.approx(sum(ratio > cap for ratio in ratios) / tokens)
    # Fresh samples are exactly the uncorrected loss.
    data["staleness"] = torch.zeros(B, dtype=torch.long)
    fresh, _ = loss_fn(student, data, tokens, B, teacher_output=teacher)
    plain, _ = FullVocabHybridLossFn(student_tau=0.5, adv_tau=0.7)(student, data, tokens, B, teacher_output=teacher)
    assert torch.equal(fresh, plain)


def test_a_monitoring_correction_leaves_the_hybrid_loss_uncorrected_and_logs_the_ratios():
    student, teacher, data = inputs(scale=1.0)
    generator = torch.Generator().manual_seed(2)
    data["generation_logprobs"] = -torch.rand(B, L, generator=generator, dtype=torch.float64) * 3
    data["staleness"] = torch.tensor([1, 0, 2])
    tokens = int(data["token_mask"][:, 1:].sum())
    greedy = GenerateStrategyConfig(decoding_method="greedy")
    results = {}
    for name, correction in (
        ("off", None),
        ("on", OffPolicyCorrection(1.5, None, None, greedy)),
        ("monitor", OffPolicyCorrection(1.5, None, None, greedy, monitor_only=True)),
    ):
        leaf = student.detach().clone().requires_grad_(True)
        loss_fn = FullVocabHybridLossFn(student_tau=0.5, adv_tau=0.7, off_policy=correction)
        loss, metrics = loss_fn(leaf, data, tokens, B, teacher_output=teacher)
        loss.backward()
        results[name] = (loss.detach(), leaf.grad, metrics)
    assert torch.equal(results["monitor"][0], results["off"][0])
    assert torch.equal(results["monitor"][1], results["off"][1])
    assert not torch.equal(results["on"][0], results["off"][0])
    assert results["monitor"][2]["is_ratio_mean"] == results["on"][2]["is_ratio_mean"] != 1.0


def test_a_one_step_off_run_weighs_its_stale_batch(tmp_path):
    config = load_config(MasterConfig, TINY_CONFIG, [
        f"output_dir={tmp_path}", "checkpointing.enabled=false", "logger.console=false", "training.max_num_steps=2",
        "training.batch_size=2", "training.micro_batch_size=2", "data.val_path=null",
        "validation.val_at_start=false", "validation.val_at_end=false", "training.scheduler=one_step_off",
        "distillation.generate_strategy.max_length=8",
        "loss_fn.type=hybrid_full_vocab", "loss_fn.adv_tau=0.5", "loss_fn.student_tau=0.5",
    ])
    distillation_train(setup(config))
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert [row["train/staleness_max"] for row in steps] == [0, 1]
    assert steps[0]["train/is_ratio_mean"] == 1.0  # fresh: every weight exactly 1
    assert steps[1]["train/is_abs_log_ratio_mean"] > 0  # the learner moved: the stale batch is weighed


def test_a_short_run_with_the_verifier_reward_trains_and_logs_it(tmp_path):
    config = load_config(MasterConfig, TINY_CONFIG, [
        f"output_dir={tmp_path}", "checkpointing.enabled=false", "logger.console=false", "training.max_num_steps=2",
        "training.batch_size=4", "training.micro_batch_size=4", "data.val_path=null",
        "validation.val_at_start=false", "validation.val_at_end=false",
        "loss_fn.type=hybrid_full_vocab", "loss_fn.adv_tau=0.5", "loss_fn.student_tau=0.5",
    ])
    distillation_train(setup(config))
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert len(steps) == 2
    assert all("train/task_reward" in row and "train/task_reward_term" in row for row in steps)
    assert all(row["train/kl_reverse"] >= 0 for row in steps)


@pytest.mark.parametrize("overrides, message", [
    (["loss_fn.type=hybrid_full_vocab", "loss_fn.adv_tau=1.0", "distillation.lambda=0.5"],
     "set distillation.lambda = 1.0"),
    # The hybrid works at temperature 1: it has no temperature key, and the key names the
    # objectives that have one.
    (["loss_fn.type=hybrid_full_vocab", "loss_fn.temperature=2.0"],
     "unknown key 'loss_fn.temperature' (temperature belongs to loss_fn.type = full_vocab / jsd / topk, "
     "not hybrid_full_vocab)"),
    (["loss_fn.type=hybrid_full_vocab", "distillation.kl_temperature=2.0"],
     "config key 'distillation.kl_temperature' has moved: it is now loss_fn.temperature"),
    # A served teacher sends hidden states for it, over opd's protocol only.
    (["loss_fn.type=hybrid_full_vocab", "teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:1",
      "teacher.remote.protocol=openai"],
     "loss_fn.type = hybrid_full_vocab with a served teacher needs its hidden states"),
])
def test_hybrid_config_mistakes_name_the_keys(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}"] + overrides)
