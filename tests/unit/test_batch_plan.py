"""The controller's split of a global batch over trainer ranks (opd.distributed.batch_plan): pure, no Ray."""

from __future__ import annotations

import random

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.batch_plan import balance_by_tokens, equalize_micro_batches, idle_micro_batch
from opd.losses.config import FullVocabLossConfig, SampledTokenLossConfig


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_row_goes_to_exactly_one_rank_with_equal_counts(seed: int, ranks: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 500) for _ in range(rng.randint(1, 33))]
    assigned = balance_by_tokens(lengths, ranks)
    assert sorted(row for rows in assigned for row in rows) == list(range(len(lengths)))
    counts = [len(rows) for rows in assigned]
    assert max(counts) - min(counts) <= 1
    assert all(rows == sorted(rows) for rows in assigned)  # original order kept within a rank
    # Balanced: no rank carries more than the ideal share plus the longest row.
    tokens = [sum(lengths[row] for row in rows) for rows in assigned]
    assert max(tokens) <= sum(lengths) / ranks + max(lengths)


def test_balance_beats_contiguous_split_on_skewed_lengths() -> None:
    lengths = [1000, 900, 10, 10, 10, 10, 10, 10]
    assigned = balance_by_tokens(lengths, 2)
    tokens = [sum(lengths[row] for row in rows) for rows in assigned]
    assert tokens == [1030, 930] or tokens == [930, 1030]  # contiguous halves would be 1930 vs 40


def test_fewer_rows_than_ranks_leaves_some_ranks_empty() -> None:
    assert balance_by_tokens([5], 3) == [[0], [], []]


def _batch(rows: int, width: int = 6) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(rows)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[:, :2] = 0
    return BatchedDataDict(
        {
            "input_ids": torch.randint(0, 50, (rows, width), generator=generator),
            "input_lengths": torch.full((rows,), width),
            "token_mask": mask,
        }
    )


def test_equalize_pads_with_idle_copies_of_each_ranks_first_micro_batch() -> None:
    a, b, c = _batch(2), _batch(3), _batch(1)
    plans = equalize_micro_batches([[a, b], [c], []])
    assert [len(plan) for plan in plans] == [2, 2, 2]
    assert plans[0] == [a, b]
    assert torch.equal(plans[1][1]["input_ids"], c["input_ids"])
    assert int(plans[1][1]["token_mask"].sum()) == 0
    assert torch.equal(plans[2][0]["input_ids"], a["input_ids"])  # an empty rank borrows a shape
    assert int(plans[2][0]["token_mask"].sum()) == 0
    assert int(c["token_mask"].sum()) > 0  # the original is not modified


@pytest.mark.parametrize("loss_config", [FullVocabLossConfig(fused_lm_head=False), SampledTokenLossConfig()])
def test_an_idle_micro_batch_adds_exactly_zero_loss_and_gradient(loss_config) -> None:
    vocab = 11
    batch = _batch(3)
    batch["input_ids"] = batch["input_ids"] % vocab
    batch["generation_logprobs"] = -torch.rand(3, 6, dtype=torch.float64)
    loss_fn = loss_config.build(vocab, "cpu")
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 6, vocab, dtype=torch.float64, generator=generator, requires_grad=True)
    teacher = torch.randn(3, 6, vocab, dtype=torch.float64, generator=generator)
    if isinstance(loss_config, SampledTokenLossConfig):
        teacher = torch.log_softmax(teacher, -1).gather(-1, batch["input_ids"].unsqueeze(-1)).squeeze(-1)
    loss, metrics = loss_fn(student, idle_micro_batch(batch), 40, 8, teacher_output=teacher)
    loss.backward()
    assert float(loss) == 0.0
    assert student.grad is not None and bool((student.grad == 0).all())
    assert all(value == 0.0 for value in metrics.values()), metrics
