"""``torch.compile`` for the fused loss's per-chunk kernels (``loss_fn.compile``).

The closed-form divergence and the KL metrics are element-wise chains and row reductions over
``[positions × vocabulary]`` tensors: eagerly one memory pass per operation, compiled a few fused passes. Compiled
once per process and kernel variant, dynamic in the chunk length; needs a C++ compiler on CPU and Triton on GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from opd.utils.compile_cache import compile_function

KernelT = TypeVar("KernelT", bound=Callable[..., object])


@functools.cache
def compiled(kernel: KernelT) -> KernelT:
    """``kernel`` compiled once per process (dynamic in the number of positions)."""
    return compile_function(kernel)


def kl_metrics_from_logits(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both KLs at temperature 1 summed over positions, and each row's log-normaliser, from ``[C, V]`` logits.

    The metric part of :class:`opd.losses.teacher_metrics.TeacherMetrics`, compiling into a few passes without writing
    the ``[C, V]`` log-probabilities. Returns ``(Σ KL(P‖Q), Σ KL(Q‖P), [C] logsumexp of the student's logits Q, [C] of
    the teacher's P)``, in float32 at least; terms where a probability is exactly 0 contribute 0.
    """
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = student_logits.to(compute_dtype)
    teacher = teacher_logits.to(compute_dtype)
    log_norm_q = torch.logsumexp(student, dim=-1, keepdim=True)
    log_norm_p = torch.logsumexp(teacher, dim=-1, keepdim=True)
    log_q = student - log_norm_q
    log_p = teacher - log_norm_p
    q, p = log_q.exp(), log_p.exp()
    zero = torch.zeros((), dtype=compute_dtype, device=student.device)
    # 0·log 0 = 0: a term whose weight is exactly 0 contributes nothing (no metric needs a gradient).
    forward = torch.where(p > 0, p * (log_p - log_q), zero).sum()
    reverse = torch.where(q > 0, q * (log_q - log_p), zero).sum()
    return forward, reverse, log_norm_q.squeeze(-1), log_norm_p.squeeze(-1)
