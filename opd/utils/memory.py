"""Peak memory of the training process, for the ``perf/peak_memory_mb`` metric."""

from __future__ import annotations

import resource

import torch


def peak_memory_mb() -> float:
    """Peak allocated GPU memory where CUDA is in use, else the process's peak resident memory, in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
