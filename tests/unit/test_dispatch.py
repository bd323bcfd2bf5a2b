"""Worker methods declare how their inputs are split over the ranks and their results gathered.

``WorkerGroup.call`` reads the declaration; these check the declarations opd's trainer
workers carry, that a method without one is refused, that per-rank shares must be one
per rank, and that the gathering functions do what they say (the ranks' metric sums add
up as micro-batches do).
"""

from __future__ import annotations

import pytest

from opd.distributed.trainer_worker import TrainerWorker
from opd.distributed.workers.dispatch import Split, declaration, dispatch, every, first, nothing, summed


def test_the_trainer_workers_declare_how_each_call_is_split_and_gathered():
    assert declaration(TrainerWorker, "train").split is Split.PER_RANK
    assert declaration(TrainerWorker, "train").gather is every
    assert declaration(TrainerWorker, "compare_with_teacher").gather is summed
    assert declaration(TrainerWorker, "whole_weights").gather is first
    for method in ("save_shards", "load_shards", "save_pretrained"):
        assert declaration(TrainerWorker, method).split is Split.SAME
        assert declaration(TrainerWorker, method).gather is nothing


def test_a_method_without_a_declaration_is_refused():
    with pytest.raises(TypeError, match=r"TrainerWorker\.pid declares no dispatch"):
        declaration(TrainerWorker, "pid")


def test_shares_must_match_the_declaration():
    class Worker:
        @dispatch(Split.PER_RANK)
        def work(self, share):
            return share

        @dispatch()
        def same(self):
            return 0

    per_rank, same = declaration(Worker, "work"), declaration(Worker, "same")
    assert per_rank.arguments("work", 2, [(1,), (2,)]) == [(1,), (2,)]
    with pytest.raises(ValueError, match=r"work takes one share per rank \(2\), got 3"):
        per_rank.arguments("work", 2, [(1,), (2,), (3,)])
    with pytest.raises(ValueError, match=r"work takes one share per rank \(2\), got None"):
        per_rank.arguments("work", 2, None)
    with pytest.raises(ValueError, match="same sends every rank the same arguments"):
        same.arguments("same", 2, [(1,), (2,)])
    assert same.arguments("same", 2, None) is None


def test_gathering_functions():
    results = [{"kl": 1.5, "count": 3.0, "ratio_max": 2.0}, {"kl": 0.5, "count": 1.0, "ratio_max": 5.0}]
    assert summed(results) == {"kl": 2.0, "count": 4.0, "ratio_max": 5.0}
    assert first(results) is results[0]
    assert every(results) is results
    assert nothing(results) is None
