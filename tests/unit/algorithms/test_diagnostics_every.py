"""``loss_fn.diagnostics_every``: the teacher-vs-student metrics on every N-th step, the loss unchanged.

The metrics (``kl_forward``, ``kl_reverse``, ``teacher_topk_mass``, ``student_mass_on_teacher_topk``,
``topk_overlap``) cost two top-k and both log-normalisers over the vocabulary in every chunk. A step that skips
them must still give bitwise the same loss and gradient, and report them only on the steps N divides.
"""

from __future__ import annotations

import json

import pytest
import torch
from opd_test_helpers import REPO_ROOT, short_run_overrides

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.kernels.fused_lm_head import LMHeadInput
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.several_teachers_loss import RoutedLoss
from opd.utils.config import ConfigError, load_config

B, L, V, D = 2, 6, 7, 5
DIAGNOSTICS = ("kl_forward", "kl_reverse", "teacher_topk_mass", "student_mass_on_teacher_topk", "topk_overlap")
LOSSES = {
    "full_vocab_fused": (lambda every: KLLossFn("mixed", 0.3, fused_lm_head=True, diagnostics_every=every), True),
    "full_vocab_logits": (lambda every: KLLossFn("reverse", diagnostics_every=every), False),
    "jsd_fused": (lambda every: JSDLossFn(0.4, fused_lm_head=True, diagnostics_every=every), True),
    "topk": (lambda every: TopKKLLossFn("forward", k=3, fused_lm_head=True, diagnostics_every=every), True),
}


def run(loss_fn, fused: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(loss, gradient of the hidden states, metrics) of one call on fixed random inputs."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, L, D, generator=generator, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(V, D, generator=generator, dtype=torch.float64)
    teacher_logits = torch.randn(B, L, V, generator=generator, dtype=torch.float64) * 2
    data = {"token_mask": torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float64)}
    if isinstance(loss_fn, TopKKLLossFn):
        teacher_output = tuple(torch.log_softmax(teacher_logits, -1).topk(3, dim=-1))
    else:
        teacher_output = teacher_logits
    student = LMHeadInput(hidden, weight) if fused else hidden @ weight.T
    loss, metrics = loss_fn(student, data, 8, 2, teacher_output=teacher_output)
    loss.backward()
    return loss.detach(), hidden.grad, metrics


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_step_without_diagnostics_has_the_same_loss_and_gradient(name):
    build, fused = LOSSES[name]
    every_third = build(3)
    diagnosing, quiet = every_third.for_step(6), every_third.for_step(7)
    assert diagnosing is not every_third and diagnosing.diagnoses and not every_third.diagnoses  # copies, not edits
    assert quiet is every_third
    loss, grad, metrics = run(diagnosing, fused)
    quiet_loss, quiet_grad, quiet_metrics = run(quiet, fused)
    assert torch.equal(loss, quiet_loss) and torch.equal(grad, quiet_grad)
    assert set(DIAGNOSTICS) <= set(metrics) and not set(DIAGNOSTICS) & set(quiet_metrics)
    assert quiet_metrics["loss"] == metrics["loss"] and quiet_metrics["num_valid_tokens"] == 8
    always = build(1)
    assert always.for_step(7) is always and set(DIAGNOSTICS) <= set(run(always, fused)[2])
    never = build(0)
    assert not never.for_step(6).diagnoses and not set(DIAGNOSTICS) & set(run(never.for_step(6), fused)[2])


def test_several_teachers_step_their_objectives():
    routed = RoutedLoss([KLLossFn(diagnostics_every=2), KLLossFn(diagnostics_every=1)], ["a", "b"])
    stepped = routed.for_step(2)
    assert stepped is not routed and [objective.diagnoses for objective in stepped.objectives] == [True, True]
    assert stepped.objective is stepped.objectives[0] and not routed.objectives[0].diagnoses
    assert routed.for_step(3) is routed


def test_a_negative_setting_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="loss_fn.diagnostics_every"):
        load_config(MasterConfig, REPO_ROOT / "examples/configs/distillation_tiny.yaml",
                    [*short_run_overrides(tmp_path), "loss_fn.diagnostics_every=-1"])
    with pytest.raises(ValueError, match="diagnostics_every must be >= 0"):
        KLLossFn(diagnostics_every=-1)


def train_records(tmp_path, name: str, every: int) -> list[dict]:
    config = load_config(
        MasterConfig,
        REPO_ROOT / "examples/configs/distillation_tiny.yaml",
        [*short_run_overrides(tmp_path, name), "training.max_num_steps=4", "checkpointing.enabled=false",
         f"loss_fn.diagnostics_every={every}"],
    )
    parts = setup(config)
    try:
        distillation_train(parts)
    finally:
        parts.close()
    lines = (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train/loss" in record]


def test_a_run_logs_the_diagnostics_on_every_second_step_and_trains_the_same(tmp_path):
    every_step, every_second = train_records(tmp_path, "every", 1), train_records(tmp_path, "second", 2)
    assert [record["step"] for record in every_second] == [1, 2, 3, 4]
    for record, reference in zip(every_second, every_step, strict=True):
        assert record["train/loss"] == reference["train/loss"]
        assert record["train/grad_norm"] == reference["train/grad_norm"]
        if record["step"] % 2 == 0:
            assert record["train/kl_forward"] == reference["train/kl_forward"]
        else:
            assert "train/kl_forward" not in record and "train/topk_overlap" not in record
