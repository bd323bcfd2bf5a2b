"""``BatchedDataDict``: a dict of equally long tensors and lists, passed between every stage of a step.

All values share the leading (batch) dimension, so row operations act on every field at once and rows stay aligned.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


class BatchedDataDict(dict):
    """A ``dict[str, Tensor | list]`` whose values all have the same batch size."""

    @property
    def size(self) -> int:
        """The batch size (0 for an empty dict); raises if fields disagree."""
        sizes = {key: len(value) for key, value in self.items()}
        if not sizes:
            return 0
        if len(set(sizes.values())) != 1:
            raise ValueError(f"BatchedDataDict fields have different batch sizes: {sizes}")
        return next(iter(sizes.values()))

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict:
        """Returns the rows at ``indices`` (in that order) of every field."""
        index_list = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        out = BatchedDataDict()
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                out[key] = value[torch.as_tensor(index_list, dtype=torch.long, device=value.device)]
            else:
                out[key] = [value[i] for i in index_list]
        return out

    def slice(self, start: int, end: int) -> BatchedDataDict:
        """Returns rows ``start:end`` of every field."""
        return BatchedDataDict({key: value[start:end] for key, value in self.items()})

    def repeat_interleave(self, repeats: int) -> BatchedDataDict:
        """Repeats each row ``repeats`` times in place order (a, a, b, b, ...)."""
        return self.select_indices([i for i in range(self.size) for _ in range(repeats)])

    def make_microbatches(self, micro_batch_size: int) -> Iterator[BatchedDataDict]:
        """Yields consecutive slices of at most ``micro_batch_size`` rows."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        for start in range(0, self.size, micro_batch_size):
            yield self.slice(start, start + micro_batch_size)

    def make_token_budget_microbatches(
        self, max_tokens: int, length_key: str = "input_lengths"
    ) -> Iterator[BatchedDataDict]:
        """Yields micro-batches of at most ``max_tokens`` (``rows × longest row``) padded tokens, longest first
        (:func:`token_budget_groups` over ``length_key``, ``[B]``)."""
        for rows in token_budget_groups(self[length_key].tolist(), max_tokens):
            yield self.select_indices(rows)

    def to(self, device: torch.device | str) -> BatchedDataDict:
        """Moves tensor fields to ``device`` (lists are left as they are)."""
        return BatchedDataDict({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})

    @staticmethod
    def concat(batches: Sequence[BatchedDataDict], pad_values: dict[str, Any] | None = None) -> BatchedDataDict:
        """Concatenates batches (same keys) row-wise, right-padding 2-D tensors with ``pad_values[key]`` (0)."""
        pad_values = pad_values or {}
        out = BatchedDataDict()
        for key in batches[0]:
            values = [batch[key] for batch in batches]
            if isinstance(values[0], torch.Tensor):
                if values[0].dim() >= 2:
                    width = max(value.shape[1] for value in values)
                    values = [
                        torch.nn.functional.pad(value, (0, width - value.shape[1]), value=pad_values.get(key, 0))
                        for value in values
                    ]
                out[key] = torch.cat(values, dim=0)
            else:
                out[key] = [item for value in values for item in value]
        return out


def token_budget_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped into micro-batches of at most ``max_tokens`` (``rows × longest row``) padded tokens.

    Greedy fill over the rows sorted longest first keeps padding low; a row over the budget goes alone. Every
    row appears once, in a new order (which a globally normalised loss does not see).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    group: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda row: -lengths[row]):
        # Sorted descending, so the group's first row is its longest.
        if group and (len(group) + 1) * lengths[group[0]] > max_tokens:
            groups.append(group)
            group = []
        group.append(row)
    if group:
        groups.append(group)
    return groups
