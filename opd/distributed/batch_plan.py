"""How the controller splits one global batch over the trainer ranks."""

from __future__ import annotations

import itertools

import torch

from opd.data.batched_data_dict import BatchedDataDict


def balance_by_tokens(lengths: list[int], ranks: int) -> list[list[int]]:
    """Row indices of each rank: equal rows (±1), about equal tokens, each rank's rows in original order.

    Longest rows first, each to the rank with the fewest tokens that still has room.
    """
    # Every rank gets `base` rows and `extra` of them one more.
    base, extra = divmod(len(lengths), ranks)
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for row in sorted(range(len(lengths)), key=lambda index: (-lengths[index], index)):
        with_extra = sum(len(rows) > base for rows in assigned)
        open_ranks = [
            rank
            for rank in range(ranks)
            if len(assigned[rank]) < base or (len(assigned[rank]) == base and with_extra < extra)
        ]
        rank = min(open_ranks, key=lambda candidate: (tokens[candidate], candidate))
        assigned[rank].append(row)
        tokens[rank] += lengths[row]
    return [sorted(rows) for rows in assigned]


def idle_micro_batch(template: BatchedDataDict) -> BatchedDataDict:
    """A micro-batch shaped like ``template`` in which no token carries loss."""
    idle = BatchedDataDict(dict(template))
    idle["token_mask"] = torch.zeros_like(template["token_mask"])
    return idle


def equalize_micro_batches(plans: list[list[BatchedDataDict]]) -> list[list[BatchedDataDict]]:
    """Pads every rank's list of micro-batches with idle ones (zero loss and gradient) up to the longest list.

    Every FSDP2 forward is a collective, so all ranks must run as many. A rank with no rows borrows another's shape.
    """
    count = max(len(plan) for plan in plans)
    template = next(plan[0] for plan in plans if plan)
    return [plan + [idle_micro_batch(plan[0] if plan else template)] * (count - len(plan)) for plan in plans]


def contiguous_blocks(data: BatchedDataDict, parts: int) -> tuple[list[BatchedDataDict], list[int]]:
    """``data`` in ``parts`` contiguous row blocks (an empty one gets a filler row), and each block's real rows."""
    spans = list(itertools.pairwise(data.size * part // parts for part in range(parts + 1)))
    blocks = [data.slice(begin, end) if end > begin else data.slice(0, 1) for begin, end in spans]
    return blocks, [end - begin for begin, end in spans]
