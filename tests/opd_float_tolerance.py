"""Tolerances derived from float32 rounding, for tests that compare two computations of one quantity.

A cluster run and the same run in one process (or a resumed run on another world size)
compute the same numbers in float32 in a different order: each of two FSDP2 ranks sums
its micro-batches' gradients and the reduce-scatter adds the ranks' sums, where one
process adds all micro-batches in turn; other CPU kernels (AVX2, AVX-512, none:
``ATEN_CPU_CAPABILITY``; another BLAS code path on another CPU) round sums, exp and log
differently again. How far the results may then be apart is a property of the
computation, derived here, not a number fitted to one machine: a tolerance fitted to one
machine (1e-5 of a LoRA adapter's largest entry) failed on another CPU (by 2.35e-8 against
2.0e-8).

``EPS32`` is float32's spacing at 1 (2^-23 = 1.19e-7); one rounding moves a number by at
most half of it, relative.
"""

from __future__ import annotations

import functools
import math

import torch

EPS32 = torch.finfo(torch.float32).eps
"""2^-23 = 1.19e-7."""
ADAM_SENSITIVITY = 2.0
"""How much Adam's update ``lr * m / (sqrt(v) + eps)`` (bias-corrected) moves, in units of ``lr``, per unit
of relative error in one step's gradient, over a run's first steps: at step 1 the update is
``lr * g / (|g| + eps)``, which moves by at most a quarter of the gradient's relative error; at step t the new
gradient enters m with weight (1 - beta1) / (1 - beta1^t) and sqrt(v) with at most sqrt(t) of the history,
which stays below 1.5 for t <= 10 (beta1 = 0.9, beta2 = 0.999)."""


def reordered_sum_error(terms: int) -> float:
    """The largest difference of two float32 sums of the same ``terms`` numbers in different orders.

    Relative to the sum of the numbers' magnitudes: each of a sum's ``terms - 1`` additions
    rounds by at most ``EPS32 / 2`` of that, in each of the two sums.
    """
    return max(terms - 1, 1) * EPS32


def adam_weight_tolerance(learning_rate: float, steps: int, micro_batches: int, entries: int) -> float:
    """How far one weight may end apart in two Adam runs that sum the same gradients in different orders.

    Derivation: an entry's gradient is a sum over the step's ``micro_batches`` gradients;
    two summation orders make it differ by :func:`reordered_sum_error` of the terms'
    magnitudes, which is that times ``kappa = sum |g_m| / |sum g_m|`` relative to the
    gradient. Adam divides every entry by its own size (:data:`ADAM_SENSITIVITY`), so the
    entry's weight moves by up to ``learning_rate * ADAM_SENSITIVITY`` times that relative
    error per step, however small the entry's gradient: in a tensor whose entries all move
    by about ``lr`` per step (a LoRA B, which starts at zero), a gradient near zero
    differs from the other run's by much more than its tensor's largest entry times EPS32.
    ``kappa`` is unbounded for one entry, but the cancellation ``|sum g_m| / sum |g_m|`` of
    an entry has a density of order 1 near 0, so the worst of ``entries`` entries has
    ``kappa`` about ``entries``. Over ``steps`` steps at most ``learning_rate`` each (a
    warm-up only lowers it), that is::

        steps * learning_rate * ADAM_SENSITIVITY * reordered_sum_error(micro_batches) * entries

    It covers other CPU kernels too: they change the same gradients by a rounding of the
    same size. Where a run's steps feed its later ones (greedy rollouts from the weights,
    the loss at the next step), the weights' difference stays far inside this: a flipped
    greedy token would move the losses, which the tests compare as well.
    """
    return steps * learning_rate * ADAM_SENSITIVITY * reordered_sum_error(micro_batches) * entries


METRIC_ZERO = EPS32
"""The absolute floor of :func:`metric_tolerance`: a metric that is 0 in both runs (a KL of equal distributions) is
a rounding of the loss's scale (about 1) away from 0 in either."""


def metric_tolerance(step: int, terms: int) -> float:
    """Relative: how far a logged metric (loss, KL, gradient norm) of two such runs may be apart at ``step``.

    Derivation: a metric is a sum of at most ``terms`` numbers of one sign (per-token
    divergences, each a sum over the vocabulary; squared gradient entries). torch sums
    float32 tensors blockwise (pairwise), so a sum rounds by at most ``log2(terms) * EPS32 /
    2`` of itself, in each run; the two runs' all-reduce adds one more rounding. From step 2
    on, the weights are a rounding apart too (:func:`adam_weight_tolerance`), which moves
    each later step's metrics by a relative rounding of the same kind, so the bound grows
    by one such term per step::

        step * (log2(terms) + 1) * EPS32

    ``terms``: the student's entries (:func:`tiny_student_entries`) bounds every sum of the
    tiny runs (the gradient norm's is the largest).
    """
    return step * (math.log2(max(terms, 2)) + 1) * EPS32


@functools.cache
def tiny_student_entries() -> int:
    """How many numbers the tiny student (``tiny:student``) holds."""
    from opd.models.tiny import build_tiny_model

    return sum(parameter.numel() for parameter in build_tiny_model("student").parameters())


def run_weight_tolerance(config, weights: dict[str, torch.Tensor]) -> float:
    """:func:`adam_weight_tolerance` of a run's ``MasterConfig``: its steps, learning rate and micro-batches."""
    from opd.distillation.config import resolve_micro_batching

    _, micro_batches = resolve_micro_batching(config)
    return adam_weight_tolerance(config.training.learning_rate, config.training.max_num_steps, micro_batches,
                                 entries(weights))


def model_entries(model_dir) -> int:
    """How many numbers a model directory's ``model.safetensors`` holds (read from its header alone)."""
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118


def entries(tensors: dict[str, torch.Tensor]) -> int:
    """How many numbers a state dict holds."""
    return sum(tensor.numel() for tensor in tensors.values())


def worst_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference between two state dicts with the same names, and the tensor it is in."""
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    worst, where = 0.0, ""
    for name, tensor in expected.items():
        difference = float((actual[name].double() - tensor.double()).abs().max()) if tensor.numel() else 0.0
        if difference >= worst:
            worst, where = difference, name
    return worst, where


def assert_weights_within(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float,
                          what: str = "final weights") -> None:
    """Every entry of ``actual`` within ``tolerance`` of ``expected`` (a bound from :func:`adam_weight_tolerance`)."""
    worst, where = worst_difference(actual, expected)
    assert worst <= tolerance, f"{what} differ by up to {worst:.2e} ({where}); the derived bound is {tolerance:.2e}"
