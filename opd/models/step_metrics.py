"""A training step's metrics, kept on the device until the step ends and then read in one host sync.

Reading a GPU tensor as a Python number (``float``, ``item``, ``bool``, ``tolist``) waits for every kernel queued
before it. A loss that reads its metrics chunk by chunk stalls the GPU dozens of times per micro-batch, so the
losses return metric values as 0-dim device tensors, :func:`accumulate_metrics` sums them there, and
:func:`read_metrics` turns the step's totals into floats at once.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

MetricValue = float | torch.Tensor
"""A metric: a Python number, or a 0-dim tensor not yet read (detached, on any device)."""


def accumulate_metrics(totals: MutableMapping[str, Any], metrics: Mapping[str, MetricValue]) -> None:
    """Adds a micro-batch's metrics to the step's: summed, except ``*_max`` keys, which keep the largest.

    Losses report each micro-batch's share of a global mean, so the sum over micro-batches and ranks is that mean.
    Tensor values stay tensors (no host sync); a maximum of a tensor and a number is a tensor.
    """
    for key, value in metrics.items():
        if key not in totals:
            totals[key] = value
        elif not key.endswith("_max"):
            totals[key] = totals[key] + value
        elif isinstance(totals[key], torch.Tensor) or isinstance(value, torch.Tensor):
            totals[key] = torch.maximum(torch.as_tensor(totals[key]), torch.as_tensor(value))
        else:
            totals[key] = max(totals[key], value)


def metric_share(value: MetricValue, denominator: float) -> MetricValue:
    """``value / denominator`` in float64 (a float32 sum divided in float32 would round once more), not read."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64) / denominator
    return value / denominator


def read_metrics(metrics: Mapping[str, MetricValue]) -> dict[str, float]:
    """``metrics`` as floats: every tensor value is read in one host sync per device (float64 on the way)."""
    read: dict[str, float] = {
        key: float(value) for key, value in metrics.items() if not isinstance(value, torch.Tensor)
    }
    by_device: dict[torch.device, list[str]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(key)
    for keys in by_device.values():
        stacked = torch.stack([torch.as_tensor(metrics[key]).detach().reshape(()).to(torch.float64) for key in keys])
        read.update(zip(keys, stacked.tolist(), strict=True))
    return {key: read[key] for key in metrics}
