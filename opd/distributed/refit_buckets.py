"""Weights packed into buckets in Ray's object store, for a refit of the rollout workers.

One ``ray.put`` per bucket of about ``bucket_bytes`` instead of one per tensor: fewer
objects and calls, and on one node each bucket is shared memory the workers map.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray
import torch


def put_in_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Any]:
    """Object refs of ``{name: CPU tensor}`` buckets of about ``bucket_bytes`` each, in the order given."""
    refs: list[Any] = []
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in weights:
        bucket[name] = tensor.cpu()
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            refs.append(ray.put(bucket))
            bucket, size = {}, 0
    if bucket:
        refs.append(ray.put(bucket))
    return refs
