"""How far the cheap teacher signals are from the exact divergence, on real generations.

A remote or memory-bound teacher often sends only its top-k log-probs per position (or
only the log-prob of the sampled token) instead of the full distribution. This script
measures what that costs on the demo models: the student (``examples/demo/models/student``)
answers held-out prompts of the arithmetic task, teacher and student score every response
position, and three approximations are compared with the exact per-position divergence
over the full vocabulary (:func:`opd.losses.divergences.token_kl`, in float64):

* **tail** — :func:`~opd.losses.divergences.topk_token_kl` with ``tail=True``: the
  teacher's k tokens plus one "rest" class. It is the exact KL of the two distributions
  coarsened to k + 1 classes, so per position 0 <= tail <= exact (a lower bound).
* **renorm** — ``tail=False``: both distributions renormalised over the teacher's top k
  (NeMo-RL's approximation). It ignores all mass outside the top k, so it has no sign
  guarantee relative to the exact KL (it is 0 at k = 1 whatever the models do).
* **sampled** — the single-sample estimate log Q(x) − log P(x) of the token x the student
  actually generated. Its expectation over x ~ Q is the reverse KL(Q‖P), so it is an
  unbiased estimator of the reverse KL only when the responses are temperature-1 samples
  of the student (``--decoding sample``, the default); under ``--decoding greedy`` it is
  biased. It needs no top-k, so it has one row, and can be negative at single positions.
  Student samples give no estimator of the forward KL(P‖Q) without more of the teacher
  than one log-prob per token, so that row (and the mixed one) reads ``n/a``.

Reported per kl_type (forward, reverse, mixed with weight 0.5), method and k:

* ``rel.err(mean)`` — (mean approx − mean exact) / mean exact over all response tokens,
  signed so the bias shows (negative: the approximation under-estimates; the JSON also
  holds its absolute value). This is the error of the training loss's value.
* ``med|rel.err|`` — median over positions with exact > 1e-6 of |approx − exact| / exact:
  how wrong a typical single position is (what the per-token gradient weights see).
* ``frac<0`` — fraction of positions where the approximation is negative.
* ``frac>exact`` — fraction of positions where it exceeds the exact value (beyond float64
  rounding); 0 is expected for tail, which is a lower bound.

The last line is machine-readable: the signed relative errors of the mean for reverse KL
at k = 8 (or the largest k asked for, when 8 is not among them)::

    topk_error kl=reverse k=8 tail=<e> renorm=<e> sampled=<e>

The demo's task is written first if it is missing (``examples/data/make_arithmetic_task.py``).

Usage: ``python benchmarks/topk_approximation_error.py [--num-prompts 128] [--seed 0]
[--decoding sample|greedy] [--ks 1,8,64] [--output FILE.json] [--smoke]`` (``--smoke``: 4
prompts, k = 1 and 8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from harness import arithmetic_task, parse_arguments

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from opd.data.dataloaders import prepare_examples  # noqa: E402
from opd.data.datasets import load_chat_dataset  # noqa: E402
from opd.data.sequences import attention_mask_from_lengths, build_token_mask, shift_token_mask  # noqa: E402
from opd.distillation.config import MasterConfig  # noqa: E402
from opd.losses.divergences import KL_TYPES, token_kl, topk_token_kl  # noqa: E402
from opd.models.decoding import GenerateStrategyConfig  # noqa: E402
from opd.models.loading import check_tokenizer_compatibility, load_tokenizer  # noqa: E402
from opd.rollout.hf_generation import HFGeneration  # noqa: E402
from opd.utils.config import load_config  # noqa: E402

DEFAULT_CONFIG = REPO / "examples" / "configs" / "demo.yaml"
TASK_DIR = REPO / "examples" / "data" / "arithmetic"
MIXED_KL_WEIGHT = 0.5
# Positions where the exact KL is below this are left out of the per-position relative
# error: there the ratio is dominated by rounding, not by the approximation.
RELATIVE_ERROR_FLOOR = 1e-6
# "Exceeds the exact value" must be more than float64 rounding of a sum over the vocabulary.
ROUNDING_SLACK = 1e-12
SUMMARY_K = 8


@dataclass
class ResponsePositions:
    """Everything the estimators need, at the positions that predict a response token.

    Attributes:
        student_logits: ``[N, V]`` float64 student logits.
        teacher_logits: ``[N, V]`` float64 teacher logits.
        next_tokens: ``[N]`` the response token each position predicts (the sampled one).
        num_sequences: how many responses the N positions come from.
        num_truncated: responses that hit the length limit before EOS.
    """

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    next_tokens: torch.Tensor
    num_sequences: int
    num_truncated: int


def parse_args() -> argparse.Namespace:
    """The command line; ``ks`` comes back as a sorted list of distinct ints."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128, help="prompts from the test split (first N)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for sampling")
    parser.add_argument(
        "--decoding",
        choices=("sample", "greedy"),
        default="sample",
        help="sample: temperature 1, no top-k/top-p (the sampled-token estimator is "
        "unbiased only then); greedy: the student's arg-max responses",
    )
    parser.add_argument("--ks", default="1,8,64", help="comma-separated teacher top-k sizes")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per generation / scoring batch")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="distillation config giving the models, data format and response length",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the results to this JSON file")
    args = parse_arguments(parser, {"num_prompts": 4, "ks": "1,8", "batch_size": 4})
    args.ks = sorted({int(k) for k in args.ks.split(",") if k.strip()})
    if not args.ks or min(args.ks) < 1:
        parser.error("--ks needs positive integers, e.g. 1,8,64")
    return args


def load_test_prompts(config: MasterConfig, tokenizer, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` test prompts, through opd's own chat-template path."""
    examples = load_chat_dataset(
        str(TASK_DIR / "test.jsonl"),
        data_format=config.data.data_format,
        prompt_file=config.data.prompt_file,
        max_examples=num_prompts,
    )
    prepared = prepare_examples(examples, tokenizer, config.data.max_prompt_length, "test split")
    return [example["prompt_ids"] for example in prepared]


def decoding_strategy(decoding: str, max_length: int) -> GenerateStrategyConfig:
    """Temperature-1 sampling from the untruncated student distribution, or greedy."""
    if decoding == "greedy":
        return GenerateStrategyConfig(decoding_method="greedy", max_length=max_length)
    # top_p = 1 keeps every token: the samples are from Q itself, as the estimator assumes.
    return GenerateStrategyConfig(decoding_method="top_p", top_p=1.0, temperature=1.0, max_length=max_length)


def score_response_positions(model: torch.nn.Module, batch, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` float64 logits at the positions whose next token is a response token.

    One forward over the right-padded sequences; logits at ``t`` predict token ``t + 1``,
    so the response mask is shifted with :func:`shift_token_mask`. Only the first
    ``vocab_size`` outputs are real tokens (a model may pad its output layer).
    """
    input_ids = batch["input_ids"]
    attention_mask = attention_mask_from_lengths(batch["input_lengths"], input_ids.shape[1])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    positions = response_position_mask(batch)
    return logits[:, :-1][positions][:, :vocab_size].to(torch.float64)


def response_position_mask(batch) -> torch.Tensor:
    """``[B, L - 1]`` bool: logit positions that predict a response token."""
    token_mask = build_token_mask(
        batch["input_lengths"], batch["prompt_lengths"], batch["input_ids"].shape[1], mask_prompt_tokens=True
    )
    return shift_token_mask(token_mask).bool()


def collect_positions(
    teacher, student, tokenizer, prompts: list[list[int]], strategy: GenerateStrategyConfig, batch_size: int
) -> tuple[ResponsePositions, float, float]:
    """Student generates, both models score; returns the positions and (generation, scoring) seconds."""
    generator = HFGeneration(student, tokenizer)
    vocab_size = len(tokenizer)
    student_parts, teacher_parts, token_parts = [], [], []
    generation_seconds = scoring_seconds = 0.0
    num_truncated = 0
    for start in range(0, len(prompts), batch_size):
        began = time.perf_counter()
        batch = generator.generate(prompts[start : start + batch_size], strategy, num_samples=1)
        generation_seconds += time.perf_counter() - began
        num_truncated += int(batch["truncated"].sum())

        began = time.perf_counter()
        student_parts.append(score_response_positions(student, batch, vocab_size))
        teacher_parts.append(score_response_positions(teacher, batch, vocab_size))
        token_parts.append(batch["input_ids"][:, 1:][response_position_mask(batch)])
        scoring_seconds += time.perf_counter() - began
    positions = ResponsePositions(
        student_logits=torch.cat(student_parts),
        teacher_logits=torch.cat(teacher_parts),
        next_tokens=torch.cat(token_parts),
        num_sequences=len(prompts),
        num_truncated=num_truncated,
    )
    return positions, generation_seconds, scoring_seconds


def exact_divergences(positions: ResponsePositions) -> dict[str, torch.Tensor]:
    """``{kl_type: [N]}`` exact per-position divergences over the full vocabulary."""
    return {
        kl_type: token_kl(positions.student_logits, positions.teacher_logits, kl_type, MIXED_KL_WEIGHT)
        for kl_type in KL_TYPES
    }


def topk_estimates(positions: ResponsePositions, ks: list[int]) -> dict[tuple[str, int, str], torch.Tensor]:
    """``{(method, k, kl_type): [N]}`` for method in tail / renorm.

    The teacher's top k come from its float64 log-softmax, as a teacher server would send
    them (normalised over the full vocabulary, sorted by probability).
    """
    teacher_log_probs = torch.log_softmax(positions.teacher_logits, dim=-1)
    estimates = {}
    for k in ks:
        top = teacher_log_probs.topk(min(k, teacher_log_probs.shape[-1]), dim=-1)
        for tail, method in ((True, "tail"), (False, "renorm")):
            for kl_type in KL_TYPES:
                estimates[(method, k, kl_type)] = topk_token_kl(
                    positions.student_logits, top.values, top.indices, kl_type, MIXED_KL_WEIGHT, tail=tail
                )
    return estimates


def sampled_token_estimate(positions: ResponsePositions) -> torch.Tensor:
    """``[N]`` log Q(x) − log P(x) of the generated token x: one-sample reverse-KL estimate."""
    tokens = positions.next_tokens.unsqueeze(-1)
    log_q = torch.log_softmax(positions.student_logits, dim=-1).gather(-1, tokens).squeeze(-1)
    log_p = torch.log_softmax(positions.teacher_logits, dim=-1).gather(-1, tokens).squeeze(-1)
    return log_q - log_p


def error_metrics(approx: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """Relative error of the mean, median per-position relative error, sign statistics."""
    mean_approx, mean_exact = approx.mean().item(), exact.mean().item()
    signed = (mean_approx - mean_exact) / mean_exact
    informative = exact > RELATIVE_ERROR_FLOOR
    per_position = ((approx - exact).abs() / exact)[informative]
    above = approx > exact + ROUNDING_SLACK * exact.abs().clamp(min=1.0)
    return {
        "mean_approx": mean_approx,
        "mean_exact": mean_exact,
        "signed_rel_err_of_mean": signed,
        "abs_rel_err_of_mean": abs(signed),
        "median_abs_rel_err": per_position.median().item() if per_position.numel() else math.nan,
        "frac_negative": (approx < 0).double().mean().item(),
        "frac_above_exact": above.double().mean().item(),
        "min_approx_minus_exact": (approx - exact).min().item(),
        "max_approx_minus_exact": (approx - exact).max().item(),
    }


def evaluate(positions: ResponsePositions, ks: list[int]) -> list[dict]:
    """One result row per (kl_type, method, k); the sampled row has k = None."""
    exact = exact_divergences(positions)
    topk = topk_estimates(positions, ks)
    sampled = sampled_token_estimate(positions)
    rows = []
    for kl_type in KL_TYPES:
        for method in ("tail", "renorm"):
            for k in ks:
                rows.append(
                    {
                        "kl_type": kl_type,
                        "method": method,
                        "k": k,
                        **error_metrics(topk[(method, k, kl_type)], exact[kl_type]),
                    }
                )
        if kl_type == "reverse":
            rows.append({"kl_type": kl_type, "method": "sampled", "k": None, **error_metrics(sampled, exact[kl_type])})
        else:  # no one-log-prob-per-token estimator of the forward direction from student samples
            rows.append(
                {"kl_type": kl_type, "method": "sampled", "k": None, "mean_exact": exact[kl_type].mean().item()}
            )
    return rows


def cpu_name() -> str:
    """The CPU model (``platform.processor()`` is empty on many Linux systems)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_model(path: str) -> str:
    """``examples/demo/models/teacher (4 layers, hidden 128)``."""
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return f"{path} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']})"


def format_table(rows: list[dict]) -> str:
    """Aligned text table, one block per kl_type, with its exact mean in the block title."""
    header = (
        f"{'kl_type':<8} {'method':<8} {'k':>3} {'mean':>10} {'rel.err(mean)':>14} {'med|rel.err|':>13} "
        f"{'frac<0':>8} {'frac>exact':>10}"
    )
    lines = [header, "-" * len(header)]
    for kl_type in KL_TYPES:
        block = [row for row in rows if row["kl_type"] == kl_type]
        lines.append(f"{kl_type:<8} {'exact':<8} {'':>3} {block[0]['mean_exact']:>10.5f}")
        for row in block:
            k = "-" if row["k"] is None else str(row["k"])
            if "mean_approx" not in row:
                lines.append(
                    f"{kl_type:<8} {row['method']:<8} {k:>3} {'n/a':>10} {'n/a':>14} {'n/a':>13} {'n/a':>8} {'n/a':>10}"
                )
                continue
            lines.append(
                f"{kl_type:<8} {row['method']:<8} {k:>3} {row['mean_approx']:>10.5f} "
                f"{row['signed_rel_err_of_mean']:>+14.4f} {row['median_abs_rel_err']:>13.4f} "
                f"{row['frac_negative']:>8.4f} {row['frac_above_exact']:>10.4f}"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def summary_line(rows: list[dict], ks: list[int]) -> str:
    """The machine-readable last line: reverse KL, one k, signed relative errors of the mean."""
    k = SUMMARY_K if SUMMARY_K in ks else max(ks)

    def signed(method: str, row_k: int | None) -> float:
        row = next(r for r in rows if r["kl_type"] == "reverse" and r["method"] == method and r["k"] == row_k)
        return row["signed_rel_err_of_mean"]

    return (
        f"topk_error kl=reverse k={k} tail={signed('tail', k):+.4f} renorm={signed('renorm', k):+.4f} "
        f"sampled={signed('sampled', None):+.4f}"
    )


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    command = "python " + shlex.join(sys.argv)
    # Paths given on the command line are relative to where the command was run.
    config_path = args.config.resolve()
    output_path = args.output.resolve() if args.output is not None else None
    os.chdir(REPO)  # the config's paths (models, prompt file) are relative to the repository root
    arithmetic_task(TASK_DIR)
    config = load_config(MasterConfig, str(config_path))
    torch.manual_seed(args.seed)

    teacher_path, student_path = config.model.teacher_model_path, config.model.student_model_path
    tokenizer = load_tokenizer(student_path)
    check_tokenizer_compatibility(tokenizer, load_tokenizer(teacher_path), student_path, teacher_path)
    if config.data.chat_template:
        tokenizer.chat_template = config.data.chat_template
    # float32 on CPU whatever the config says: the comparison is about the estimators, and
    # bf16 logits would add their own error to every row.
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # keep the report free of loading bars
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval().requires_grad_(False)
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32).eval().requires_grad_(False)

    prompts = load_test_prompts(config, tokenizer, args.num_prompts)
    strategy = decoding_strategy(args.decoding, config.distillation.generate_strategy.max_length)
    positions, generation_seconds, scoring_seconds = collect_positions(
        teacher, student, tokenizer, prompts, strategy, args.batch_size
    )
    began = time.perf_counter()
    rows = evaluate(positions, args.ks)
    estimator_seconds = time.perf_counter() - began
    total_seconds = time.perf_counter() - started

    decoding = (
        "sample (temperature 1.0, no top-k/top-p)" if args.decoding == "sample" else "greedy"
    ) + f", max {strategy.max_length} new tokens, seed {args.seed}"
    print(
        f"teacher: {describe_model(teacher_path)}; student: {describe_model(student_path)}; "
        f"vocab {positions.student_logits.shape[-1]}"
    )
    print(
        f"{len(prompts)} test prompts, {positions.next_tokens.numel()} response tokens "
        f"({positions.num_truncated} cut at the length limit); decoding {decoding}"
    )
    print(f"torch {torch.__version__}, {cpu_name()}, {torch.get_num_threads()} threads; command: {command}")
    print(
        f"time: generation {generation_seconds:.1f}s, scoring {scoring_seconds:.1f}s, "
        f"estimators {estimator_seconds:.1f}s, total {total_seconds:.1f}s"
    )
    print(
        "rel.err(mean) = (mean approx - mean exact) / mean exact; med|rel.err| over positions with exact > "
        f"{RELATIVE_ERROR_FLOOR:g}; mixed = {MIXED_KL_WEIGHT} forward + {1 - MIXED_KL_WEIGHT} reverse"
    )
    print()
    print(format_table(rows))
    print()
    if output_path is not None:
        results = {
            "teacher": teacher_path,
            "student": student_path,
            "num_prompts": len(prompts),
            "num_response_tokens": positions.next_tokens.numel(),
            "num_truncated": positions.num_truncated,
            "decoding": args.decoding,
            "seed": args.seed,
            "ks": args.ks,
            "torch": torch.__version__,
            "cpu": cpu_name(),
            "command": command,
            "seconds": total_seconds,
            "rows": rows,
        }
        output_path.parent.mkdir(parents=True, exist_ok=True)
        output_path.write_text(json.dumps(results, indent=2), encoding="utf-8")
        print(f"wrote {output_path}")
    print(summary_line(rows, args.ks))


if __name__ == "__main__":
    main()
