"""Token-budget micro-batching (dynamic batching): how rows are grouped, and that one
optimizer step gives the same loss and gradients as a single large batch."""

from __future__ import annotations

import functools

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_sequences
from opd.losses.distillation_losses import KLLossFn
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.teachers.local_teacher import LocalTeacher

LENGTHS = [5, 23, 9, 9, 31, 2, 17, 12]


def batch_of(lengths: list[int]) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 120, (n,), generator=generator).tolist() for n in lengths]
    batch = pack_sequences(sequences, [max(1, n // 3) for n in lengths], 0, True)
    batch["row_id"] = torch.arange(len(lengths))
    return batch


@pytest.mark.parametrize("budget", [1, 20, 31, 40, 64, 1000])
def test_every_row_once_within_budget_longest_first(budget):
    batch = batch_of(LENGTHS)
    micro_batches = list(batch.make_token_budget_microbatches(budget))
    seen = [int(row) for micro in micro_batches for row in micro["row_id"]]
    assert sorted(seen) == list(range(len(LENGTHS)))
    flat_lengths = [int(n) for micro in micro_batches for n in micro["input_lengths"]]
    assert flat_lengths == sorted(LENGTHS, reverse=True)
    for micro in micro_batches:
        padded = micro.size * int(micro["input_lengths"].max())
        assert padded <= budget or micro.size == 1, (budget, micro["input_lengths"].tolist())
        # Greedy: the next row would not have fit.
    for current, following in zip(micro_batches, micro_batches[1:]):
        assert (current.size + 1) * int(current["input_lengths"].max()) > budget


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        next(batch_of(LENGTHS).make_token_budget_microbatches(0))


def one_step(batch, loss_fn, teacher, micro_batch_size, micro_batch_tokens):
    model = build_tiny_model("student", dtype=torch.float64)
    policy = HFPolicy(model, OptimizerConfig(learning_rate=1e-3, max_grad_norm=None), micro_batch_size, 1,
                      micro_batch_tokens=micro_batch_tokens)
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    policy.optimizer.register_step_pre_hook(lambda opt, *_: grads.update(
        {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}))
    metrics = policy.train(batch, loss_fn,
                           teacher_signal=functools.partial(teacher.score, request=loss_fn.teacher_request))
    return metrics, grads


@pytest.mark.parametrize("loss_kind", ["kl", "sampled-token"])
@pytest.mark.parametrize("budget", [31, 60, 100])
def test_token_budget_step_equals_one_large_batch(loss_kind, budget):
    batch = batch_of(LENGTHS)
    del batch["row_id"]
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    if loss_kind == "kl":
        loss_fn = KLLossFn("mixed", 0.3, temperature=1.2, kl_reduction="sum")
    else:
        generator = torch.Generator().manual_seed(5)
        batch["generation_logprobs"] = -3 - torch.rand(batch["input_ids"].shape, generator=generator, dtype=torch.float64)
        batch["task_reward"] = torch.tensor([1.0, 0.0] * 4, dtype=torch.float64)
        loss_fn = SampledTokenLossFn(discount=0.7, adv_tau=0.5, clip_ratio=None)
    reference_metrics, reference_grads = one_step(batch, loss_fn, teacher, batch.size, None)
    metrics, grads = one_step(batch, loss_fn, teacher, batch.size, budget)
    assert reference_metrics["grad_norm"] > 1e-4
    for key, value in reference_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
