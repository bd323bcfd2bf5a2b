"""Weights packed into buckets in Ray's object store, for a refit of the rollout workers.

One ``ray.put`` per bucket rather than per tensor; :func:`in_buckets` also groups the FSDP2 trainer's all-gathers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def in_buckets(
    entries: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``entries`` in order, grouped: a bucket closes at the first tensor that brings it to ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` is a bucket of its own; no bucket is empty.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in entries:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def bucket_bytes_of(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """The bytes of a bucket's tensors."""
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)


def put_in_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[Any], int]:
    """Object refs of ``{name: CPU tensor}`` buckets of about ``bucket_bytes`` each, in order, and their bytes."""
    import ray  # only where the weights go to rollout workers

    refs, sent = [], 0
    for bucket in in_buckets(weights, bucket_bytes):
        refs.append(ray.put({name: tensor.cpu() for name, tensor in bucket}))
        sent += bucket_bytes_of(bucket)
    return refs, sent
