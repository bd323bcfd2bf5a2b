"""Micro-batching by a token budget (dynamic batching) and by a row count, both over rows sorted longest
first: how rows are grouped, and that one optimizer step gives the same loss and gradients as a single large
batch."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_sequences
from opd.losses.distillation_losses import KLLossFn
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy, OptimizerConfig, plan_micro_batches
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


def padded_tokens(micro_batches) -> int:
    return sum(micro.size * int(micro["input_lengths"].max()) for micro in micro_batches)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3, 5, 7])
def test_fixed_size_micro_batches_take_the_rows_longest_first(micro_batch_size):
    batch = batch_of(LENGTHS)
    micro_batches = plan_micro_batches(batch, micro_batch_size)
    full, remainder = divmod(len(LENGTHS), micro_batch_size)
    sizes = [micro.size for micro in micro_batches]
    assert sorted(sizes) == sorted([micro_batch_size] * full + ([remainder] if remainder else []))
    assert sorted(int(row) for micro in micro_batches for row in micro["row_id"]) == list(range(len(LENGTHS)))
    flat_lengths = [int(n) for micro in micro_batches for n in micro["input_lengths"]]
    assert flat_lengths == sorted(LENGTHS, reverse=True)
    for micro in micro_batches:  # each trimmed to its own longest row
        assert micro["input_ids"].shape[1] == int(micro["input_lengths"].max())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("micro_batch_size", [2, 3, 4])
def test_the_cut_pads_the_least_of_any_grouping_into_those_sizes(seed, micro_batch_size):
    """Against every ordering of 7 random lengths cut into the same sizes (all 5,040 of them)."""
    lengths = torch.randint(1, 40, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    micro_batches = plan_micro_batches(batch_of(lengths), micro_batch_size)
    sizes = [micro.size for micro in micro_batches]

    def cost(ordered: tuple[int, ...]) -> int:
        bounds = list(itertools.accumulate([0, *sizes]))
        return sum(size * max(ordered[start:end]) for size, start, end in zip(sizes, bounds, bounds[1:]))

    fewest = min(cost(ordering) for ordering in itertools.permutations(lengths))
    assert padded_tokens(micro_batches) == fewest


def test_a_batch_that_is_one_micro_batch_keeps_its_order():
    batch = batch_of(LENGTHS)
    (micro,) = plan_micro_batches(batch, len(LENGTHS))
    assert micro["row_id"].tolist() == list(range(len(LENGTHS)))


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
@pytest.mark.parametrize(("micro_batch_size", "budget"), [(None, 31), (None, 60), (None, 100), (3, None)])
def test_token_budget_step_equals_one_large_batch(loss_kind, micro_batch_size, budget):
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
    metrics, grads = one_step(batch, loss_fn, teacher, micro_batch_size or batch.size, budget)
    assert reference_metrics["grad_norm"] > 1e-4
    for key, value in reference_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
