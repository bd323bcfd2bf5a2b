"""The off-policy correction (truncated importance weights) against a plain float64 reference.

* :func:`importance_weights` on random ratios: truncation at the cap, the token and the
  sequence masks, the token and the sequence level, fresh rows left at exactly 1, against a
  loop written out in Python.
* :func:`sampling_log_probs`: the learner's log-prob under the sampler's distribution
  (temperature, top-k, top-p, greedy) equals what the sampler itself reports.
* :class:`DistillationLossFn` with the correction: on fresh samples the loss and every
  gradient are bitwise those of the uncorrected loss; on stale samples the loss equals
  Σ_t w_t · D_t / N computed in float64 from the logits, on the plain and the fused path,
  for the full-vocabulary and the top-k losses; all-masked and empty rows give zero.
* ``enabled: monitor``: the loss and gradient are bitwise those without a correction, and
  the ratio metrics are those of the weighing correction, in the loss and in a
  ``one_step_off`` run; weighing samples drawn through a top-k or top-p filter is warned of.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig, TrainingConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.config import (
    FullVocabLossConfig,
    HybridFullVocabLossConfig,
    JSDLossConfig,
    SampledTokenLossConfig,
    TopKLossConfig,
)
from opd.losses.distillation_losses import DistillationLossFn, KLLossFn, TopKKLLossFn
from opd.losses.divergences import token_kl, topk_token_kl
from opd.losses.off_policy import (
    OffPolicyCorrection,
    OffPolicyCorrectionConfig,
    filtered_sampling_warning,
    importance_weights,
    learner_log_probs,
    sampling_log_probs,
)
from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import LMHeadInput
from opd.rollout.sampling import next_tokens
from opd.utils.config import load_config

TOP_P = GenerateStrategyConfig(decoding_method="top_p", temperature=0.7, top_p=0.9)
TOP_K = GenerateStrategyConfig(decoding_method="top_k", temperature=1.3, top_k=5)
GREEDY = GenerateStrategyConfig(decoding_method="greedy")
SAMPLE = GenerateStrategyConfig(decoding_method="top_p", temperature=1.0, top_p=1.0)


def correction(cap=2.0, token_bounds=None, sequence_bounds=None, strategy=SAMPLE, level="token") -> OffPolicyCorrection:
    return OffPolicyCorrection(cap, token_bounds, sequence_bounds, strategy, level)


def reference_weights(learner, sampler, stale, sequence_ids, cap, token_bounds, sequence_bounds, level="token"):
    """The weights written out position by position in Python floats, and the ratio each was cut from."""
    n = len(learner)
    ratios = [math.exp(learner[i] - sampler[i]) if stale[i] else 1.0 for i in range(n)]

    def geometric_mean(i):
        members = [j for j in range(n) if sequence_ids[j] == sequence_ids[i]]
        return math.exp(sum(math.log(ratios[j]) for j in members) / len(members))

    weighed = [geometric_mean(i) if level == "sequence" and stale[i] else ratios[i] for i in range(n)]
    weights = [min(r, cap) for r in weighed]
    for i in range(n):
        if not stale[i]:
            continue
        if token_bounds is not None and not token_bounds[0] <= ratios[i] <= token_bounds[1]:
            weights[i] = 0.0
        if sequence_bounds is not None and not sequence_bounds[0] <= geometric_mean(i) <= sequence_bounds[1]:
            weights[i] = 0.0
    return weights, ratios, weighed


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("token_bounds", [None, (0.5, 1.5)])
@pytest.mark.parametrize("sequence_bounds", [None, (0.8, 1.25)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_importance_weights_match_a_python_reference(seed, token_bounds, sequence_bounds, level):
    generator = torch.Generator().manual_seed(seed)
    n = 40
    sampler = -torch.rand(n, generator=generator, dtype=torch.float64) * 3
    # Sequence-level ratios are means of seven log-ratios: a wider spread keeps some past the cap.
    spread = 0.6 if level == "token" else 1.5
    learner = sampler + torch.randn(n, generator=generator, dtype=torch.float64) * spread
    sequence_ids = torch.arange(n) // 7  # six sequences of 7 positions and one of 5
    stale = sequence_ids != 2  # one fresh sequence among stale ones (a mixed micro-batch)
    cap = 1.7 if level == "token" else 1.2
    weights, sums = importance_weights(
        learner, sampler, stale, sequence_ids, correction(cap, token_bounds, sequence_bounds, level=level)
    )
    expected, ratios, weighed = reference_weights(
        learner.tolist(),
        sampler.tolist(),
        stale.tolist(),
        sequence_ids.tolist(),
        cap,
        token_bounds,
        sequence_bounds,
        level,
    )
    assert weights.dtype == torch.float64
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.equal(weights[~stale], torch.ones(int((~stale).sum()), dtype=torch.float64))
    if level == "sequence" and sequence_bounds is None and token_bounds is None:
        # One weight per sequence: every position of a stale sequence shares it.
        for sequence in sequence_ids.unique():
            members = weights[sequence_ids == sequence]
            assert torch.all(members == members[0])
        assert len({round(w, 12) for w in expected}) > 2  # the sequences' weights differ
    assert sums["is_ratio"] == pytest.approx(sum(ratios), rel=1e-12)
    assert sums["is_truncated"] == sum(r > cap for r in weighed)
    assert sums["is_masked"] == sum(w == 0.0 for w in expected)
    assert sums["is_ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    if token_bounds is None and sequence_bounds is None:
        assert sums["is_masked"] == 0
    assert 0 < sums["is_truncated"] < n  # the case exercises truncation both ways


def test_fresh_rows_have_weight_exactly_one_even_with_disagreeing_log_probs():
    learner = torch.tensor([-0.1, -5.0, -2.0])
    sampler = torch.tensor([-3.0, -0.2, -2.5])
    weights, sums = importance_weights(
        learner,
        sampler,
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.long),
        correction(1.0, (0.9, 1.1)),
    )
    assert torch.equal(weights, torch.ones(3, dtype=torch.float64))
    assert sums == {
        "is_ratio": 3.0,
        "is_abs_log_ratio": 0.0,
        "is_truncated": 0.0,
        "is_masked": 0.0,
        "is_outside_support": 0.0,
        "is_ratio_max": 1.0,
    }


def test_a_token_the_learner_would_never_sample_gets_weight_zero():
    # Learner log-prob -inf: the token lies outside the learner's top-k / top-p support.
    weights, sums = importance_weights(
        torch.tensor([float("-inf"), -1.0]),
        torch.tensor([-2.0, -1.0]),
        torch.ones(2, dtype=torch.bool),
        torch.zeros(2, dtype=torch.long),
        correction(),
    )
    assert weights.tolist() == [0.0, 1.0]
    assert sums["is_outside_support"] == 1.0


def test_no_rows():
    empty = torch.zeros(0)
    weights, sums = importance_weights(
        empty,
        empty,
        torch.zeros(0, dtype=torch.bool),
        torch.zeros(0, dtype=torch.long),
        correction(1.5, (0.5, 2), (0.5, 2)),
    )
    assert weights.numel() == 0 and sums["is_ratio_max"] == 0.0


@pytest.mark.parametrize("strategy", [TOP_P, TOP_K, GREEDY, SAMPLE], ids=["top_p", "top_k", "greedy", "plain"])
def test_learner_log_probs_are_the_samplers_own(strategy):
    torch.manual_seed(0)
    logits = torch.randn(9, 30) * 3
    tokens, sampler_logprobs = next_tokens(logits, strategy, return_logprobs=True)
    torch.testing.assert_close(sampling_log_probs(logits, tokens, strategy), sampler_logprobs, rtol=0, atol=1e-6)
    # From hidden states and a head, chunk by chunk: the same numbers.
    hidden, weight = torch.randn(9, 4), torch.randn(30, 4)
    head_logits = hidden @ weight.T
    tokens, _ = next_tokens(head_logits, strategy, return_logprobs=True)
    torch.testing.assert_close(
        learner_log_probs(LMHeadInput(hidden, weight), tokens, strategy),
        sampling_log_probs(head_logits, tokens, strategy),
        rtol=0,
        atol=1e-6,
    )
    # A head that scales and soft-caps its logits (Gemma 2): the sampler drew from the transformed logits.
    capped = torch.tanh(head_logits * 0.5 / 2.0) * 2.0
    tokens, _ = next_tokens(capped, strategy, return_logprobs=True)
    torch.testing.assert_close(
        learner_log_probs(LMHeadInput(hidden, weight, logit_multiplier=0.5, logit_softcap=2.0), tokens, strategy),
        sampling_log_probs(capped, tokens, strategy),
        rtol=0,
        atol=1e-6,
    )


def test_config_checks_bounds():
    with pytest.raises(ValueError, match="token_bounds"):
        OffPolicyCorrectionConfig(token_bounds=(1.2, 3.0))
    with pytest.raises(ValueError, match="cap"):
        OffPolicyCorrectionConfig(cap=0.5)
    assert OffPolicyCorrectionConfig().is_on(asynchronous=True)
    assert not OffPolicyCorrectionConfig().is_on(asynchronous=False)
    assert OffPolicyCorrectionConfig(enabled=True).is_on(asynchronous=False)
    assert not OffPolicyCorrectionConfig().is_on(asynchronous=True, by_default=False)
    assert OffPolicyCorrectionConfig(enabled=True).is_on(asynchronous=True, by_default=False)


@pytest.mark.parametrize(
    ("loss", "by_default"),
    [
        (FullVocabLossConfig(), False),
        (JSDLossConfig(), False),
        (TopKLossConfig(k=4), False),
        (SampledTokenLossConfig(), False),
        (HybridFullVocabLossConfig(), True),
    ],
    ids=lambda value: getattr(value, "type", str(value)),
)
def test_auto_weighs_stale_samples_only_for_a_sampled_token_term(loss, by_default):
    # The correction study (guide §11) found the truncated ratio slowed learning for the
    # exact-expectation losses; the hybrid loss's reward term is a policy gradient.
    for scheduler in ("one_step_off", "two_step_off"):
        assert TrainingConfig(scheduler=scheduler).correction_is_on(loss) is by_default
        forced = TrainingConfig(scheduler=scheduler, off_policy_correction=OffPolicyCorrectionConfig(enabled=True))
        assert forced.correction_is_on(loss)
    assert not TrainingConfig(scheduler="sync").correction_is_on(loss)


# --------------------------------------------------------------------------- the loss

B, L, V, D = 3, 7, 13, 5


def micro_batch(seed: int, staleness: list[int]):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, L), generator=generator)
    token_mask = torch.zeros(B, L)
    token_mask[0, 3:7] = 1  # full response
    token_mask[1, 2:5] = 1  # shorter, then padding
    # row 2: an empty response (no loss positions)
    generation_logprobs = -torch.rand(B, L, generator=generator) * 2
    return {
        "input_ids": input_ids,
        "token_mask": token_mask,
        "generation_logprobs": generation_logprobs * token_mask,
        "staleness": torch.tensor(staleness),
    }, generator


def reference_log_ratios(student_logits, data, strategy):
    """{(row, t): log ρ} of every response position of a stale row, one position at a time."""
    log_ratios = {}
    for row in range(B):
        for t in range(L - 1):
            if data["token_mask"][row, t + 1] and data["staleness"][row] > 0:
                token = data["input_ids"][row, t + 1]
                learner = float(sampling_log_probs(student_logits[row, t].double()[None], token[None], strategy))
                log_ratios[row, t] = learner - float(data["generation_logprobs"][row, t + 1])
    return log_ratios


def reference_loss(student_logits, teacher, data, cap, strategy, signal, level="token"):
    """Σ_t w_t · D_t / N in float64, one position at a time."""
    total, count = 0.0, int(data["token_mask"][:, 1:].sum())
    log_ratios = reference_log_ratios(student_logits, data, strategy)
    for row in range(B):
        row_logs = [value for (r, _), value in log_ratios.items() if r == row]
        for t in range(L - 1):
            if data["token_mask"][row, t + 1] == 0:
                continue
            logits = student_logits[row, t].double()
            if signal == "topk":
                divergence = topk_token_kl(
                    logits[None], teacher[0][row, t][None].double(), teacher[1][row, t][None], "forward"
                )
            else:
                divergence = token_kl(logits[None], teacher[row, t].double()[None], "forward")
            weight = 1.0
            if data["staleness"][row] > 0:
                log_ratio = sum(row_logs) / len(row_logs) if level == "sequence" else log_ratios[row, t]
                weight = min(math.exp(log_ratio), cap)
            total += weight * float(divergence)
    return total / count


def forward_kl(signal, **settings) -> DistillationLossFn:
    """The forward KL over the teacher's ``signal``: its top 4 (``topk``), or its full vocabulary (top-4 metrics)."""
    if signal == "topk":
        return TopKKLLossFn("forward", k=4, **settings)
    return KLLossFn("forward", metrics_topk=4, **settings)


def losses_with_corrections(seed, staleness, signal, fused, corrections):
    """Each correction's loss, gradient and metrics on one random micro-batch (float32, chunks of 3 rows)."""
    data, generator = micro_batch(seed, staleness=staleness)
    hidden = torch.randn(B, L, D, generator=generator)
    head = torch.randn(V, D, generator=generator)
    teacher_logits = torch.randn(B, L, V, generator=generator) * 2
    top = torch.log_softmax(teacher_logits, -1).topk(4, dim=-1)
    teacher = teacher_logits if signal == "full_vocab" else (top.values, top.indices)
    results = []
    for off_policy in corrections:
        loss_fn = forward_kl(signal, fused_lm_head=fused, chunk_size=3, off_policy=off_policy)
        leaf = hidden.clone().requires_grad_(True)
        student = LMHeadInput(leaf, head) if fused else leaf @ head.T
        loss, metrics = loss_fn(student, data, int(data["token_mask"][:, 1:].sum()), B, teacher_output=teacher)
        loss.backward()
        results.append((loss.detach(), leaf.grad, metrics))
    return results


@pytest.mark.parametrize("signal", ["full_vocab", "topk"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_fresh_samples_give_the_uncorrected_loss_bitwise(signal, fused):
    corrections = (None, correction(1.2, (0.9, 1.1), (0.95, 1.05)))
    (loss_plain, grad_plain, _), (loss_corrected, grad_corrected, metrics) = losses_with_corrections(
        0, [0, 0, 0], signal, fused, corrections
    )
    assert torch.equal(loss_plain, loss_corrected)
    assert torch.equal(grad_plain, grad_corrected)
    assert metrics["is_ratio_mean"] == 1.0 and metrics["is_masked_fraction"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("signal", ["full_vocab", "topk"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("strategy", [SAMPLE, TOP_P], ids=["plain", "top_p"])
def test_stale_samples_are_weighted_as_the_reference(signal, fused, strategy, level):
    data, generator = micro_batch(1, staleness=[1, 0, 2])
    hidden = torch.randn(B, L, D, generator=generator, dtype=torch.float64)
    head = torch.randn(V, D, generator=generator, dtype=torch.float64)
    teacher_logits = torch.randn(B, L, V, generator=generator, dtype=torch.float64) * 2
    top = torch.log_softmax(teacher_logits, -1).topk(4, dim=-1)
    teacher = teacher_logits if signal == "full_vocab" else (top.values, top.indices)
    # The sampler's log-probs: the learner's own, moved by a known amount per position.
    student_logits = hidden @ head.T
    data["input_ids"][0, 3] = student_logits[0, 2].argmax()  # inside every top-p support
    own = sampling_log_probs(student_logits[:, :-1].reshape(-1, V), data["input_ids"][:, 1:].reshape(-1), strategy)
    shift = torch.randn(B, L - 1, generator=generator, dtype=torch.float64) * 0.5
    shift[0, 2] = -1.0  # the first response token of row 0: ratio e > cap
    data["generation_logprobs"] = torch.zeros(B, L, dtype=torch.float64)
    # A token outside the learner's top-p support (own log-prob -inf) was inside the
    # sampler's: ratio 0, weight 0.
    data["generation_logprobs"][:, 1:] = own.nan_to_num(neginf=-6.0).view(B, L - 1) + shift
    cap = 1.3
    loss_fn = forward_kl(signal, fused_lm_head=fused, chunk_size=2, off_policy=correction(cap, strategy=strategy, level=level))
    student = LMHeadInput(hidden, head) if fused else student_logits
    loss, metrics = loss_fn(student, data, int(data["token_mask"][:, 1:].sum()), B, teacher_output=teacher)
    expected = reference_loss(student_logits, teacher, data, cap, strategy, signal, level)
    assert float(loss) == pytest.approx(expected, rel=1e-10)
    if level == "token":
        assert metrics["is_truncated_fraction"] > 0  # some weights hit the cap
    assert metrics["is_ratio_max"] > cap
    # The two levels weigh differently: the case tells them apart.
    other = "sequence" if level == "token" else "token"
    assert expected != pytest.approx(reference_loss(student_logits, teacher, data, cap, strategy, signal, other))


@pytest.mark.parametrize("signal", ["full_vocab", "topk"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_monitor_logs_the_ratios_and_leaves_the_loss_and_gradient_uncorrected(signal, fused):
    weighing = correction(1.2, (0.9, 1.1))
    monitoring = OffPolicyCorrection(1.2, (0.9, 1.1), None, SAMPLE, "token", monitor_only=True)
    (loss_off, grad_off, _), (loss_on, _, metrics_on), (loss_monitor, grad_monitor, metrics_monitor) = (
        losses_with_corrections(3, [1, 0, 2], signal, fused, (None, weighing, monitoring))
    )
    assert torch.equal(loss_monitor, loss_off) and torch.equal(grad_monitor, grad_off)
    assert not torch.equal(loss_on, loss_off)  # the weights matter here: monitoring really leaves them out
    ratio_metrics = [key for key in metrics_on if key.startswith("is_")]
    assert len(ratio_metrics) == 6
    assert {key: metrics_monitor[key] for key in ratio_metrics} == {key: metrics_on[key] for key in ratio_metrics}
    assert metrics_monitor["is_masked_fraction"] > 0  # what the bounds would have masked


def test_monitor_is_on_under_an_asynchronous_schedule_for_every_corrected_loss():
    monitor = OffPolicyCorrectionConfig(enabled="monitor")
    assert monitor.is_on(asynchronous=True, by_default=False) and not monitor.is_on(asynchronous=False)
    assert not monitor.weighs and OffPolicyCorrectionConfig(enabled=True).weighs
    assert OffPolicyCorrection.from_config(monitor, SAMPLE).monitor_only
    assert not OffPolicyCorrection.from_config(OffPolicyCorrectionConfig(enabled=True), SAMPLE).monitor_only
    for loss in (FullVocabLossConfig(), TopKLossConfig(k=4), HybridFullVocabLossConfig()):
        assert TrainingConfig(scheduler="one_step_off", off_policy_correction=monitor).correction_is_on(loss)


@pytest.mark.parametrize(
    ("strategy", "warned"),
    [(TOP_P, "top_p = 0.9"), (TOP_K, "top_k = 5"), (GREEDY, None), (SAMPLE, None)],
    ids=["top_p", "top_k", "greedy", "plain"],
)
def test_weighing_samples_drawn_through_a_filter_is_warned_of(strategy, warned):
    warning = filtered_sampling_warning(correction(strategy=strategy))
    if warned is None:
        assert warning is None
    else:
        assert warned in warning and "weight 0" in warning and "enabled: monitor" in warning
    monitoring = OffPolicyCorrection(2.0, None, None, strategy, "token", monitor_only=True)
    assert filtered_sampling_warning(monitoring) is None  # nothing is weighed


def test_all_masked_micro_batch_with_stale_rows_is_zero():
    data, generator = micro_batch(2, staleness=[1, 1, 1])
    data["token_mask"].zero_()
    leaf = torch.randn(B, L, D, generator=generator).requires_grad_(True)
    loss_fn = KLLossFn("reverse", fused_lm_head=True, off_policy=correction())
    loss, metrics = loss_fn(LMHeadInput(leaf, torch.randn(V, D)), data, 0, B, teacher_output=torch.randn(B, L, V))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(leaf.grad) == 0
    assert metrics["is_ratio_max"] == 0.0


# --------------------------------------------------------------------------- a run


def _one_step_off_run(tmp_path, enabled: str, *extra: str) -> list[dict]:
    config = load_config(
        MasterConfig,
        REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml",
        [
            f"output_dir={tmp_path / enabled}",
            "checkpointing.enabled=false",
            "logger.console=false",
            "training.max_num_steps=2",
            "training.batch_size=2",
            "training.micro_batch_size=2",
            "data.val_path=null",
            "validation.val_at_start=false",
            "validation.val_at_end=false",
            "training.scheduler=one_step_off",
            "distillation.generate_strategy.max_length=8",
            f"training.off_policy_correction.enabled={enabled}",
            *extra,
        ],
    )
    distillation_train(setup(config))
    rows = [json.loads(line) for line in (tmp_path / enabled / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "train/loss" in row]


def test_a_monitored_run_trains_as_an_uncorrected_one_and_logs_the_ratios(tmp_path, caplog):
    # Plain sampling at temperature 1 (the tiny config's strategy is greedy): the stale
    # batch's ratios move away from 1, and top_p = 0.9 makes the weighing run warn.
    sampling = [
        "distillation.generate_strategy.decoding_method=top_p",
        "distillation.generate_strategy.temperature=1.0",
    ]
    with caplog.at_level(logging.WARNING, logger="opd"):
        off = _one_step_off_run(tmp_path, "false", *sampling)
        monitor = _one_step_off_run(tmp_path, "monitor", *sampling)
        assert "decoding_method = top_p" not in caplog.text  # neither weighs anything
        weighing = _one_step_off_run(tmp_path, "true", *sampling, "distillation.generate_strategy.top_p=0.9")
    assert [row["train/staleness_max"] for row in monitor] == [0, 1]
    assert [row["train/loss"] for row in monitor] == [row["train/loss"] for row in off]
    assert [row["train/grad_norm"] for row in monitor] == [row["train/grad_norm"] for row in off]
    assert "train/is_ratio_mean" not in off[1]  # off computes no ratios
    assert monitor[0]["train/is_ratio_mean"] == 1.0 and monitor[1]["train/is_abs_log_ratio_mean"] > 0
    assert "decoding_method = top_p (top_p = 0.9" in caplog.text and weighing[1]["train/is_ratio_mean"] > 0
