"""How precisely the top-k divergence keeps a small teacher rest mass, before and after the fix.

:func:`opd.losses.divergences.topk_token_kl` (``tail=True``) needs the teacher's
"rest" mass 1 − Σ_k P outside its top k. Until the fix it was computed by subtraction in
the dtype of the log-probs, ``-expm1(logsumexp(top-k))`` in float32, which loses a rest
mass of 1e-6 or less to cancellation. This script builds teachers whose top k hold
exactly 1 − r of the mass (r = 1e-2 … 1e-7), as a float32 model would send them, and
compares three ways of getting the per-position divergence against a float64 reference:

* **before** — the old formula, reproduced here (:func:`old_topk_token_kl`);
* **after: from top-k** — the library as called with only ``(log-probs, ids)``: the rest is
  ``log1mexp(logsumexp(top-k))`` in float64 (what a vLLM teacher gets);
* **after: teacher-sent** — the library with the rest the teacher sends itself
  (``teacher_rest_logprobs``: a logsumexp over its other tokens in float32, what
  LocalTeacher and ``opd serve-teacher`` send).

The reference is the same divergence in float64 from the same float32 teacher and student
logits (upcast), with the teacher's exact rest. Two kinds of teacher log-probs, one table each:

* **fp32 log-softmax** — the teacher computes ``log_softmax`` in float32 (a float32 model,
  LocalTeacher, ``opd serve-teacher``, vLLM): every log-prob then shares the rounding
  error of the float32 normaliser (~ulp(log Z), a few 1e-7), which shifts Σ_k P by that
  much. No formula can take it back out of the top-k alone: only the teacher-sent rest
  (a ratio of its own sums, where that error cancels) is exact.
* **rounded fp64** — the log-probs are exact and then rounded to float32 one by one (a
  teacher that normalises in float64): the subtraction is then the only error, and the
  float64 ``log1mexp`` removes it.

Inputs: ``--positions`` rows of a
``--vocab``-entry vocabulary, top ``--k``; the student is the teacher's logits times 0.6
plus noise, so it keeps ~1-30% of its mass outside the teacher's top k (the reverse KL
weighs log P_rest by that mass, so it is the direction the rest matters most for).

Reported, per rest mass and direction: the relative error of the summed divergence
(``|Σ D − Σ D_ref| / Σ D_ref``, the error of the loss value) and the largest per-position
relative error. Run::

    OMP_NUM_THREADS=1 python benchmarks/rest_mass_precision.py [--positions 256] [--vocab 4096] [--k 64] [--seed 0]

(``--smoke``: 16 positions of a 256-entry vocabulary, k = 8.)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from harness import parse_arguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from opd.kernels.topk_rest import rest_logprobs_outside
from opd.losses.divergences import topk_token_kl

REST_MASSES = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
DIRECTIONS = ("forward", "reverse", "mixed")
MIXED_WEIGHT = 0.5


def old_topk_token_kl(
    student_logits: torch.Tensor, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, kl_type: str
) -> torch.Tensor:
    """The top-k divergence as computed before the fix: the teacher rest as 1 − Σ_k P in the input dtype."""
    compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_q_full = torch.log_softmax(student_logits.to(compute_dtype), dim=-1)
    log_q = log_q_full.gather(-1, topk_ids)
    log_p = topk_logprobs.to(compute_dtype)
    in_topk = torch.zeros_like(log_q_full, dtype=torch.bool).scatter_(-1, topk_ids, True)
    log_q_rest = torch.logsumexp(log_q_full.masked_fill(in_topk, float("-inf")), dim=-1, keepdim=True)
    p_rest = -torch.expm1(torch.logsumexp(log_p, dim=-1, keepdim=True))  # the subtraction
    log_p_rest = torch.log(p_rest.clamp(min=torch.finfo(compute_dtype).tiny))
    return _kl(torch.cat([log_p, log_p_rest], -1), torch.cat([log_q, log_q_rest], -1), kl_type)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Forward, reverse or mixed KL over the last dimension (all classes have mass here)."""
    forward = (log_p.exp() * (log_p - log_q)).sum(-1)
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1)
    return {"forward": forward, "reverse": reverse}.get(kl_type, MIXED_WEIGHT * forward + (1 - MIXED_WEIGHT) * reverse)


def make_case(rest: float, positions: int, vocab: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 teacher and student logits ``[positions, vocab]``; the teacher's top k hold 1 − ``rest``."""
    generator = torch.Generator().manual_seed(seed)
    top = 2.0 * torch.randn(positions, k, generator=generator, dtype=torch.float64)
    others = torch.randn(positions, vocab - k, generator=generator, dtype=torch.float64)
    shift = math.log(rest / (1 - rest)) + top.logsumexp(-1) - others.logsumexp(-1)
    teacher = torch.cat([top, others + shift[:, None]], -1)
    student = 0.6 * teacher.clamp(min=-30.0) + torch.randn(positions, vocab, generator=generator, dtype=torch.float64)
    return teacher.float(), student.float()


def measure(rest: float, args: argparse.Namespace, teacher_kind: str) -> dict[str, dict[str, tuple[float, float]]]:
    """``{direction: {method: (relative error of the sum, max per-position relative error)}}``."""
    teacher, student = make_case(rest, args.positions, args.vocab, args.k, args.seed)
    log_p64 = torch.log_softmax(teacher.double(), -1)
    # What the teacher sends: float32 log-probs, normalised in float32 or in float64.
    log_p32 = torch.log_softmax(teacher, -1) if teacher_kind == "fp32 log-softmax" else log_p64.float()
    values, ids = log_p32.topk(args.k, -1)
    sent_rest = rest_logprobs_outside(log_p32 if teacher_kind == "fp32 log-softmax" else log_p64, ids).float()
    log_q64 = torch.log_softmax(student.double(), -1)
    in_topk = torch.zeros_like(log_p64, dtype=torch.bool).scatter_(-1, ids, True)
    exact_p_rest = log_p64.masked_fill(in_topk, float("-inf")).logsumexp(-1, keepdim=True)
    exact_q_rest = log_q64.masked_fill(in_topk, float("-inf")).logsumexp(-1, keepdim=True)
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for kl_type in DIRECTIONS:
        reference = _kl(
            torch.cat([log_p64.gather(-1, ids), exact_p_rest], -1),
            torch.cat([log_q64.gather(-1, ids), exact_q_rest], -1),
            kl_type,
        )
        methods = {
            "before": old_topk_token_kl(student, values, ids, kl_type),
            "from_topk": topk_token_kl(student, values, ids, kl_type, MIXED_WEIGHT),
            "sent": topk_token_kl(student, values, ids, kl_type, MIXED_WEIGHT, teacher_rest_logprobs=sent_rest),
        }
        results[kl_type] = {
            name: (
                abs(float(value.double().sum() - reference.sum())) / float(reference.sum()),
                float(((value.double() - reference).abs() / reference).max()),
            )
            for name, value in methods.items()
        }
    results["student_rest"] = {"mean": (float(exact_q_rest.exp().mean()), 0.0)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_arguments(parser, {"positions": 16, "vocab": 256, "k": 8})
    print(
        f"top-k divergence vs float64 reference: {args.positions} positions, vocab {args.vocab}, k {args.k}, "
        f"float32 inputs, seed {args.seed}"
    )
    print("relative error of the summed divergence (max per-position relative error in brackets)")
    for teacher_kind in ("fp32 log-softmax", "rounded fp64"):
        print(f"\nteacher log-probs: {teacher_kind}")
        header = f"{'rest mass':>9} {'KL':>8} | {'before (1 - sum, fp32)':>24} | {'after: from top-k':>24} | "
        header += f"{'after: teacher-sent':>24} | student rest"
        print(header)
        print("-" * len(header))
        for rest in REST_MASSES:
            results = measure(rest, args, teacher_kind)
            student_rest = results["student_rest"]["mean"][0]
            for kl_type in DIRECTIONS:
                cells = [f"{total:9.2e} [{worst:9.2e}]" for total, worst in results[kl_type].values()]
                label = f"{rest:9.0e}" if kl_type == DIRECTIONS[0] else " " * 9
                row = " | ".join(f"{cell:>24}" for cell in cells)
                print(f"{label} {kl_type:>8} | {row} | {student_rest:.2e}")


if __name__ == "__main__":
    main()
