"""What kind of device opd computes on: the one place a device's type is read.

A device is a ``torch.device`` or a name (``cuda:1``); torch is not imported, so :mod:`opd.utils.compile_cache` can ask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA GPU."""
    return _device_type(device) == "cuda"


def is_cpu(device: torch.device | str) -> bool:
    """Whether ``device`` is the host's CPU."""
    return _device_type(device) == "cpu"


def use_tf32_matmuls(enabled: bool, device: torch.device | str) -> None:
    """On CUDA, float32 matmuls in TF32 (``enabled``) or full float32; nothing elsewhere.

    Process-wide (torch's backend flags): every process that loads a model for ``device`` sets it the same way.
    """
    if not is_cuda(device):
        return
    import torch

    torch.backends.cuda.matmul.fp32_precision = "tf32" if enabled else "ieee"


def _device_type(device: torch.device | str) -> str:
    """``cuda`` of ``cuda:1`` or of ``torch.device("cuda", 1)``: the device's type without its index."""
    return str(device).partition(":")[0]
