"""Peak memory of the training process, for the ``perf/peak_memory_mb`` metric."""

from __future__ import annotations

import resource

import torch

from opd.utils.devices import is_cuda


def peak_memory_mb() -> float:
    """Peak allocated GPU memory where CUDA is in use, else the process's peak resident memory, in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def release_cached_memory(device: torch.device) -> None:
    """Hands the caching allocator's free blocks back to the device (no-op off CUDA), for the next phase to use."""
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
