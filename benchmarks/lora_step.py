"""Peak memory and time of one training step: LoRA student vs full fine-tuning.

Both modes run :meth:`opd.policy.hf_policy.HFPolicy.train` (AdamW, the policy's
micro-batching and clipping) with the token-level NLL loss on the same seeded batch of
random token ids, on the same randomly initialised Qwen2 model, so the difference is
only what LoRA changes: which parameters get gradients and Adam moments, and the extra
adapter matmuls in forward and backward. The loss needs no teacher, so the teacher's
cost (the same in both modes) is left out.

How it measures:

* each mode runs in a fresh worker process (``--worker``), so each peak belongs to one
  measurement and no allocator cache carries over;
* the worker builds the model and the policy (for LoRA: wraps it with peft), returns
  glibc's free heap to the OS (``malloc_trim``), reads the resident set size
  (``VmRSS``) as the baseline and resets the kernel's high-water mark (``5`` into
  ``/proc/self/clear_refs``); then it runs ``--warmup`` steps and ``--repeats`` timed
  steps (``time.perf_counter``). Peak = ``VmHWM`` − baseline over all those steps: the
  memory training adds to the loaded model (activations, gradients, Adam's two moments,
  which AdamW allocates at the first step). On CUDA the peak is
  ``torch.cuda.max_memory_allocated`` above the allocation after loading;
* ``Adam state`` is counted exactly from the optimizer's tensors after the steps.

Usage: ``python benchmarks/lora_step.py [--hidden 512] [--layers 4] [--vocab 8192]
[--batch 8] [--seq-len 256] [--rank 16] [--repeats 5] [--device cpu] [--smoke]``
(``--smoke``: one layer of hidden size 64, a 256-entry vocabulary, 2 × 32 tokens, one
timed step). Run it on an
otherwise idle machine; set ``OMP_NUM_THREADS`` to the cores it may use.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from harness import parse_arguments


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    """Frees glibc's cached heap and resets VmHWM to the current resident size."""
    with contextlib.suppress(OSError):  # not glibc: the baseline may then include freed memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One mode's measurement, in this (fresh) process."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opd.data.sequences import pack_sequences
    from opd.losses.nll import NLLLossFn
    from opd.models.config import LoraConfig, OptimizerConfig
    from opd.policy.hf_policy import HFPolicy

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=max(2048, args.seq_len),
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(device)
    lora = LoraConfig(r=args.rank, alpha=2.0 * args.rank) if args.mode == "lora" else None
    policy = HFPolicy(model, OptimizerConfig(learning_rate=1e-4), args.batch, total_steps=1000, lora=lora)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, args.vocab, (args.seq_len,), generator=generator).tolist() for _ in range(args.batch)]
    batch = pack_sequences(sequences, [args.seq_len // 4] * args.batch, 0, True)
    loss_fn = NLLLossFn()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        _reset_peak()
        baseline = _read_status_kib("VmRSS") * 1024
    times = []
    for step in range(args.warmup + args.repeats):
        start = time.perf_counter()
        metrics = policy.train(batch, loss_fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = _read_status_kib("VmHWM") * 1024 - baseline
    adam_bytes = sum(
        tensor.numel() * tensor.element_size()
        for state in policy.optimizer.state.values()
        for tensor in state.values()
        if torch.is_tensor(tensor) and tensor.dim() > 0
    )
    return {
        "mode": args.mode,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "adam_mib": adam_bytes / 2**20,
        "peak_mib": peak / 2**20,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "loss": metrics["loss"],
    }


SMOKE = {
    "hidden": 64,
    "intermediate": 128,
    "layers": 1,
    "vocab": 256,
    "batch": 2,
    "seq_len": 32,
    "rank": 4,
    "repeats": 1,
}
"""``--smoke``: the smallest model the script builds (one attention head), one timed step."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 r, the default target modules)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", choices=["full", "lora"], dest="mode", help=argparse.SUPPRESS)
    args = parse_arguments(parser, SMOKE)
    if args.mode is not None:
        print(json.dumps(worker(args)))
        return
    forwarded = list(sys.argv[1:])
    rows = []
    for mode in ("full", "lora"):
        output = subprocess.run(
            [sys.executable, __file__, *forwarded, "--worker", mode],
            check=True,
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])),
            },
        )
        rows.append(json.loads(output.stdout.strip().splitlines()[-1]))
    print(
        f"Qwen2 hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab} "
        f"(tied); batch {args.batch} x {args.seq_len} tokens, NLL loss, fp32 on {args.device}; "
        f"LoRA r={args.rank}, alpha={2 * args.rank}; median of {args.repeats} steps after {args.warmup} warm-up"
    )
    print()
    print(
        "| mode | params | trainable | Adam state (MiB) | step peak above the loaded model (MiB) "
        "| step time, median (s) | min–max (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['params']:,} | {row['trainable']:,} | {row['adam_mib']:.1f} | "
            f"{row['peak_mib']:.1f} | {row['median_s']:.3f} | {row['min_s']:.3f}–{row['max_s']:.3f} |"
        )
    full, lora = rows
    print()
    print(
        f"lora_step lora/full peak_mem={lora['peak_mib'] / full['peak_mib']:.3f} "
        f"time={lora['median_s'] / full['median_s']:.3f} trainable={lora['trainable'] / full['trainable']:.4f}"
    )


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
