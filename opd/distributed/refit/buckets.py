"""Weights packed into buckets in Ray's object store, for a refit of the rollout workers.

One ``ray.put`` per bucket rather than per tensor; :func:`in_buckets` also groups the FSDP2 trainer's all-gathers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def module_group(name: str) -> str:
    """The part of the model a weight belongs to, which a bucket never splits: its decoder layer, else its module.

    ``model.layers.3.self_attn.q_proj.weight`` → ``model.layers.3`` (the path up to its first numeric part);
    ``model.norm.weight`` → ``model.norm``. A vLLM engine fuses a layer's q/k/v and gate/up projections into one
    parameter and reloads a layer from each ``load_weights`` call: a call holding only some of its parts leaves
    the rest of the fused parameter uninitialised.
    """
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:-1]) or name


def in_buckets(
    entries: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``entries`` in order, grouped: a bucket that has reached ``bucket_bytes`` closes where its last
    :func:`module_group` ends, so no decoder layer or module is split between buckets.

    A group larger than ``bucket_bytes`` is a bucket of its own; no bucket is empty.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in entries:
        if size >= bucket_bytes and module_group(name) != module_group(bucket[-1][0]):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
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
