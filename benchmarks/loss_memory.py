"""Peak memory and time of the distillation loss alone: opd's fused loss vs TRL vs naive.

With Qwen's 151,669-token vocabulary, a distillation loss that materialises logits holds
several ``[tokens × vocab]`` fp32 tensors at once, 5 GB *each* at 8,192 tokens. opd's
fused loss (:func:`opd.kernels.fused_lm_head.chunked_lm_head_loss`) makes the logits
chunk by chunk from the final hidden states and the LM-head weights instead. This script
measures what that buys, for the loss alone (no model around it): forward + backward at
vocabulary V = 151,669 and hidden size D = 1,536 (Qwen2.5-1.5B's head), fp32 on CPU, for
N tokens, of

* **opd fused** — ``chunked_lm_head_loss`` with :func:`opd.losses.divergences.generalized_jsd`
  (β = 0.5) and its closed-form gradient (``full_vocab_divergence_with_grad``), as
  ``DistillationLossFn`` runs it, and the teacher given as its hidden states and head (an in-process teacher:
  its logits are made per chunk, without gradient);
* **TRL** — ``GKDTrainer.generalized_jsd_loss`` (β = 0.5, TRL's default) called as
  ``GKDTrainer.compute_loss`` calls it: full student logits (with gradient) and teacher
  logits (without) shaped ``[1, N, V]``, ``labels`` with every position valid, the
  default ``"batchmean"`` reduction (Σ / number of valid labels, i.e. the mean over
  positions of the per-position JSD);
* **naive** — plain PyTorch forward KL(P‖Q) of full logits:
  ``F.kl_div(log_softmax(s), log_softmax(t), log_target=True).sum(-1).mean()``.

Every method starts from the same inputs — both models' final hidden states ``[N, D]``
(the student's requires grad) and both heads ``[V, D]`` (the student's requires grad) —
and its timed region holds both head matmuls, the divergence, its mean over positions
and the whole backward pass, which ends with the gradients of the student's hidden
states and head weight. So all three do the same work and, for opd and TRL, compute the
same value (checked: the run prints the relative difference of the two losses).

How it measures:

* each (method, N) runs in a fresh worker process (``--worker``), so each peak belongs
  to one measurement and no allocator cache carries over;
* the worker builds seeded inputs (hidden ~ N(0, 1), heads ~ N(0, 0.02²) like a real LM
  head), runs the method once at 32 tokens as a warm-up (one-time library
  initialisation, not the big shapes: a full-size warm-up would double the run time of
  the largest N), drops the warm-up's gradients, then reads the resident set size
  (``VmRSS``) as the baseline, resets the kernel's high-water mark (``5`` into
  ``/proc/self/clear_refs``) and runs forward + backward once, timed with
  ``time.perf_counter``. Before the baseline, glibc's free heap memory is returned to the
  OS (``malloc_trim``), so the run cannot hide allocations in memory freed earlier.
  Peak = ``VmHWM`` − baseline: the *extra* memory the loss needs, the weight gradient
  (``V × D`` fp32, 889 MiB) included for every method;
* the worker's address space is capped (``RLIMIT_AS``, ``--cap-gib``) so that a method
  needing more memory than the machine has fails with a clean allocation error, reported
  as ``OOM``, instead of waking the kernel's OOM killer. A method that fails needed at
  least the larger of its peak so far and its resident memory at the failure plus the
  refused request (both above the baseline, both measured), so for an ``OOM`` cell the
  table gives that lower bound, the opd/other memory ratio is an upper bound ``<x``,
  and the time ratio is ``nan``. Nothing is extrapolated.

The last line is machine-readable, for the largest N:
``loss_memory opd/trl N=8192 peak_mem=<ratio> time=<ratio>`` (plus ``trl=oom@<cap>GiB``
when the TRL path did not fit).

Usage: ``python benchmarks/loss_memory.py [--sizes 512,2048,8192] [--cap-gib 20]
[--chunk-rows ROWS] [--repeats 1] [--vocab 151669] [--hidden 1536] [--smoke]``
(``--smoke``: N = 64 at V = 2,048, D = 64). Run it on an otherwise idle machine with at least
``--cap-gib`` of free memory: the time columns assume the worker has the cores to itself.
The default run takes about 11 minutes on 2 CPU cores (mostly opd at N = 8,192; the
methods that do not fit fail after their first few allocations).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from harness import parse_arguments

VOCAB = 151_669
"""Qwen2/2.5/3 vocabulary (real tokens; the padded head of some checkpoints is larger): ``--vocab``'s default."""
HIDDEN = 1536
"""Qwen2.5-1.5B's hidden size: ``--hidden``'s default."""
BETA = 0.5
"""JSD interpolation weight: TRL's GKD default, used for opd too so both compute one objective."""
HEAD_SCALE = 0.02
"""Standard deviation of the random head weights (the usual LM initialisation)."""
WARMUP_TOKENS = 32
SEED = 0
METHODS = ("opd", "trl", "naive")
METHOD_TITLES = {"opd": "opd fused", "trl": "TRL", "naive": "naive"}
RESULT_PREFIX = "LOSS_MEMORY_RESULT "
MIB = 2**20
GIB = 2**30


# --------------------------------------------------------------------------------------
# Worker: one (method, N) measurement in its own process.
# --------------------------------------------------------------------------------------


def _process_memory() -> dict[str, int]:
    """This process's ``VmRSS``, ``VmHWM`` (peak RSS) and ``VmSize`` in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        text = status.read()
    return {
        key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024
        for key in ("VmRSS", "VmHWM", "VmSize")
    }


def _reset_peak_memory() -> None:
    """Sets ``VmHWM`` back to the current RSS (Linux ≥ 4.0), so the next peak is this run's."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
        clear_refs.write("5")


def _release_free_heap() -> None:
    """Returns glibc's freed heap memory to the OS (``malloc_trim``), so the baseline RSS
    holds no free memory that the measured run could reuse without raising the peak."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the baseline may include some free memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _is_allocation_failure(error: BaseException) -> bool:
    """True for the error torch raises when the address-space cap refuses an allocation."""
    message = str(error)
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in message or "Cannot allocate memory" in message)
    )


def _trl_generalized_jsd_loss() -> tuple[Callable[..., Any], str]:
    """TRL's ``GKDTrainer.generalized_jsd_loss`` and where it was found.

    GKD moved to ``trl.experimental.gkd`` in recent releases; older ones have it in
    ``trl.trainer.gkd_trainer``.
    """
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        from trl.trainer.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss, f"{GKDTrainer.__module__}.GKDTrainer.generalized_jsd_loss"


def _make_inputs(tokens: int, generator: Any, vocab: int, hidden_size: int) -> dict[str, Any]:
    """Final hidden states of both models and both LM heads, fp32."""
    import torch

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(*shape, generator=generator, dtype=torch.float32)
        return values.mul_(scale) if scale != 1.0 else values

    return {
        "student_hidden": randn(tokens, hidden_size).requires_grad_(True),
        "student_weight": randn(vocab, hidden_size, scale=HEAD_SCALE).requires_grad_(True),
        "teacher_hidden": randn(tokens, hidden_size),
        "teacher_weight": randn(vocab, hidden_size, scale=HEAD_SCALE),
    }


def _loss_functions(chunk_rows: int | None) -> dict[str, Callable[..., Any]]:
    """Each method's ``(student_hidden, student_weight, teacher_hidden, teacher_weight) -> loss``.

    Imports lazily, so a worker loads only what its method needs.
    """
    import torch
    import torch.nn.functional as F

    def opd_loss(hidden, weight, teacher_hidden, teacher_weight):
        import functools

        from opd.kernels.fused_lm_head import chunked_lm_head_loss
        from opd.losses.divergences import full_vocab_divergence_with_grad, generalized_jsd
        from opd.models.lm_head import LMHeadInput

        tokens = hidden.shape[0]
        # Weight 1/N per position: the mean over positions, as TRL's batchmean and the naive mean.
        position_weights = torch.full((tokens,), 1.0 / tokens, dtype=torch.float64)
        # As DistillationLossFn's fused path: the closed-form gradient of the JSD (its
        # per-step metrics are left out; TRL's loss computes none either).
        return chunked_lm_head_loss(
            LMHeadInput(hidden, weight),
            functools.partial(generalized_jsd, beta=BETA),
            (LMHeadInput(teacher_hidden, teacher_weight),),
            position_weights,
            chunk_rows=chunk_rows,
            value_and_grad=functools.partial(full_vocab_divergence_with_grad, jsd_beta=BETA),
        )

    def trl_loss(hidden, weight, teacher_hidden, teacher_weight):
        generalized_jsd_loss, _ = _trl_generalized_jsd_loss()
        tokens = hidden.shape[0]
        # As GKDTrainer.compute_loss: the models' [B, T, V] logits (here B = 1), the
        # teacher's under no_grad, and labels whose -100 entries are masked out (none here).
        student_logits = F.linear(hidden, weight).view(1, tokens, weight.shape[0])
        with torch.no_grad():
            teacher_logits = F.linear(teacher_hidden, teacher_weight).view(1, tokens, teacher_weight.shape[0])
        labels = torch.zeros((1, tokens), dtype=torch.long)
        return generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=BETA)

    def naive_loss(hidden, weight, teacher_hidden, teacher_weight):
        student_logits = F.linear(hidden, weight)
        with torch.no_grad():
            teacher_logits = F.linear(teacher_hidden, teacher_weight)
        # F.kl_div(input=log Q, target=log P) is KL(P‖Q): the forward KL.
        per_position = F.kl_div(
            F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1), log_target=True, reduction="none"
        ).sum(-1)
        return per_position.mean()

    return {"opd": opd_loss, "trl": trl_loss, "naive": naive_loss}


def run_worker(
    method: str,
    tokens: int,
    cap_gib: float,
    chunk_rows: int | None,
    repeats: int,
    vocab: int = VOCAB,
    hidden_size: int = HIDDEN,
) -> dict[str, Any]:
    """Measures one method at one size (``tokens`` positions, a ``vocab × hidden_size`` head); returns the record.

    The address-space cap is set before torch is imported, so it covers everything the
    process maps.
    """
    cap_bytes = int(cap_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))
    import torch

    torch.set_num_threads(int(os.environ.get("LOSS_MEMORY_THREADS", "2")))
    loss_fn = _loss_functions(chunk_rows)[method]
    record: dict[str, Any] = {"method": method, "tokens": tokens, "torch_threads": torch.get_num_threads()}
    if method == "trl":
        record["trl_function"] = _trl_generalized_jsd_loss()[1]
    if method == "opd":
        from opd.models.lm_head import default_chunk_rows

        record["chunk_rows"] = chunk_rows or default_chunk_rows(vocab)

    generator = torch.Generator().manual_seed(SEED)
    inputs = _make_inputs(tokens, generator, vocab, hidden_size)
    hidden, weight = inputs["student_hidden"], inputs["student_weight"]
    teacher_hidden, teacher_weight = inputs["teacher_hidden"], inputs["teacher_weight"]

    # Warm-up at a small size: first-call costs (thread pools, kernel selection) stay out
    # of the timing. Its weight gradient is dropped so the measured peak includes the
    # measured run's own weight gradient.
    warmup_hidden = hidden.detach()[:WARMUP_TOKENS].clone().requires_grad_(True)
    loss_fn(warmup_hidden, weight, teacher_hidden[:WARMUP_TOKENS], teacher_weight).backward()
    del warmup_hidden
    weight.grad = None

    times, peaks = [], []
    for _ in range(repeats):
        hidden.grad, weight.grad = None, None  # each repeat allocates its gradients afresh
        _release_free_heap()
        baseline = _process_memory()
        _reset_peak_memory()
        start = time.perf_counter()
        try:
            loss = loss_fn(hidden, weight, teacher_hidden, teacher_weight)
            loss.backward()
        except (RuntimeError, MemoryError) as error:
            if not _is_allocation_failure(error):
                raise
            # Two measured lower bounds of the memory the method needs above the baseline:
            # the most it held (VmHWM), and what it held when it failed plus the refused
            # request (big tensors are returned to the OS when freed, so what is resident
            # is in use).
            now = _process_memory()
            request = re.search(r"allocate (\d+) bytes", str(error))
            refused = int(request.group(1)) if request else 0
            record.update(
                status="oom",
                cap_bytes=cap_bytes,
                baseline_rss=baseline["VmRSS"],
                baseline_vmsize=baseline["VmSize"],
                held_at_failure=now["VmRSS"] - baseline["VmRSS"],
                peak_before_failure=now["VmHWM"] - baseline["VmRSS"],
                refused_request=refused,
                needs_more_than=max(now["VmHWM"] - baseline["VmRSS"], now["VmRSS"] - baseline["VmRSS"] + refused),
                error=str(error).splitlines()[0][:200],
            )
            return record
        elapsed = time.perf_counter() - start
        peaks.append(_process_memory()["VmHWM"] - baseline["VmRSS"])
        times.append(elapsed)
        record["baseline_rss"] = baseline["VmRSS"]
        record["loss"] = loss.item()
        del loss
    # Gradient norms, after timing: a cheap check that opd and TRL agree on the gradients too.
    record.update(
        status="ok",
        seconds=min(times),
        all_seconds=times,
        peak_bytes=max(peaks),
        grad_hidden_norm=hidden.grad.norm().item(),
        grad_weight_norm=weight.grad.norm().item(),
    )
    return record


# --------------------------------------------------------------------------------------
# Driver: runs the workers one after another and prints the table.
# --------------------------------------------------------------------------------------


def _memory_available() -> int:
    """``MemAvailable`` from /proc/meminfo, in bytes."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read(), re.MULTILINE).group(1)) * 1024


def _machine_header(arguments: argparse.Namespace) -> list[str]:
    """CPU, memory, library versions and the exact command, one per line."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read(), re.MULTILINE)
        cpu = match.group(1).strip() if match else cpu
    except OSError:
        pass
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        total = int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo.read(), re.MULTILINE).group(1)) * 1024

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    command = " ".join(shlex.quote(part) for part in ["python", os.path.relpath(__file__), *sys.argv[1:]])
    return [
        "loss_memory: forward + backward of the distillation loss alone (final hidden states -> loss -> grads)",
        f"machine: {cpu}, {os.cpu_count()} cores, {total / GIB:.1f} GiB RAM, {platform.system()} {platform.release()}",
        f"python {platform.python_version()}, torch {version('torch')}, trl {version('trl')}, "
        f"transformers {version('transformers')}; {os.environ.get('LOSS_MEMORY_THREADS', '2')} torch threads",
        f"V={arguments.vocab:,}, D={arguments.hidden}, dtype=float32, device=cpu, JSD beta={BETA} (opd, TRL), "
        "forward KL (naive), mean over positions",
        f"per worker: address-space cap {arguments.cap_gib:g} GiB (RLIMIT_AS), warm-up at {WARMUP_TOKENS} tokens, "
        f"{arguments.repeats} timed run(s) (min time, max peak); peak = VmHWM - VmRSS before the run",
        f"command: {command}",
    ]


def _run_one(method: str, tokens: int, arguments: argparse.Namespace) -> dict[str, Any]:
    """Runs one worker process and returns its record (status ``crashed`` if it died)."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        method,
        "--tokens",
        str(tokens),
        "--cap-gib",
        str(arguments.cap_gib),
        "--repeats",
        str(arguments.repeats),
    ]
    command += ["--vocab", str(arguments.vocab), "--hidden", str(arguments.hidden)]
    if arguments.chunk_rows:
        command += ["--chunk-rows", str(arguments.chunk_rows)]
    available = _memory_available()
    if available < arguments.cap_gib * GIB:
        # Below the cap the kernel's OOM killer, not the cap, may stop a big worker.
        print(
            f"  warning: only {available / GIB:.1f} GiB available, below the {arguments.cap_gib:g} GiB cap", flush=True
        )
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("LOSS_MEMORY_THREADS", "2"),
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, env=environment)
    wall = time.perf_counter() - started
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            record = json.loads(line[len(RESULT_PREFIX) :])
            record["worker_wall_s"] = wall
            return record
    reason = (
        f"signal {signal.Signals(-completed.returncode).name}"
        if completed.returncode < 0
        else f"exit {completed.returncode}"
    )
    tail = "\n".join(completed.stderr.strip().splitlines()[-5:])
    return {
        "method": method,
        "tokens": tokens,
        "status": "crashed",
        "error": f"{reason}: {tail}",
        "worker_wall_s": wall,
    }


def _peak_cell(record: dict[str, Any]) -> str:
    if record["status"] == "ok":
        return f"{record['peak_bytes'] / MIB:,.0f}"
    if record["status"] == "oom":
        return f"OOM (>{record['needs_more_than'] / MIB:,.0f})"
    return "crashed"


def _time_cell(record: dict[str, Any]) -> str:
    return f"{record['seconds']:.2f}" if record["status"] == "ok" else "-"


def _ratios(opd: dict[str, Any], other: dict[str, Any]) -> tuple[str, str]:
    """(memory, time) ratios opd/other as text: exact, ``<x`` upper bound, or ``nan``."""
    if opd["status"] != "ok":
        return "nan", "nan"
    if other["status"] == "ok":
        return f"{opd['peak_bytes'] / other['peak_bytes']:.3f}", f"{opd['seconds'] / other['seconds']:.3f}"
    if other["status"] == "oom":
        # The other method needed more than `needs_more_than`, so opd/other is below this.
        return f"<{opd['peak_bytes'] / other['needs_more_than']:.3f}", "nan"
    return "nan", "nan"


def _relative_difference(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else float("nan")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def run_driver(arguments: argparse.Namespace) -> None:
    """Runs every (N, method) worker in turn, then prints the table and the summary line."""
    started = time.perf_counter()
    for line in _machine_header(arguments):
        print(line, flush=True)
    results: dict[tuple[int, str], dict[str, Any]] = {}
    for tokens in arguments.sizes:
        for method in METHODS:
            record = _run_one(method, tokens, arguments)
            results[tokens, method] = record
            if record["status"] == "ok":
                detail = (
                    f"peak {record['peak_bytes'] / MIB:,.0f} MiB, {record['seconds']:.2f} s, loss {record['loss']:.8g}"
                )
            elif record["status"] == "oom":
                detail = (
                    f"OOM under the cap: held {record['held_at_failure'] / MIB:,.0f} MiB "
                    f"(peak {record['peak_before_failure'] / MIB:,.0f}), "
                    f"refused {record['refused_request'] / MIB:,.0f} MiB more"
                )
            else:
                detail = f"{record['status']}: {record.get('error', '')}"
            print(
                f"  N={tokens:>5} {METHOD_TITLES[method]:<9} {detail}  [worker {record['worker_wall_s']:.0f} s]",
                flush=True,
            )

    opd_info = next((r for r in results.values() if r["method"] == "opd" and "chunk_rows" in r), {})
    trl_info = next((r for r in results.values() if r["method"] == "trl" and "trl_function" in r), {})
    print(
        f"opd: chunked_lm_head_loss, chunk_rows={opd_info.get('chunk_rows', '?')}; "
        f"TRL: {trl_info.get('trl_function', '?')}"
    )
    print()
    header = ["N"]
    for method in METHODS:
        header += [f"{METHOD_TITLES[method]} MiB", f"{METHOD_TITLES[method]} s"]
    header += ["mem opd/TRL", "time opd/TRL", "mem opd/naive", "time opd/naive"]
    rows = [header]
    for tokens in arguments.sizes:
        row = [f"{tokens:,}"]
        for method in METHODS:
            row += [_peak_cell(results[tokens, method]), _time_cell(results[tokens, method])]
        row += [
            *_ratios(results[tokens, "opd"], results[tokens, "trl"]),
            *_ratios(results[tokens, "opd"], results[tokens, "naive"]),
        ]
        rows.append(row)
    for line in _table(rows):
        print(line)
    print(
        "MiB: peak extra resident memory of forward + backward (weight gradient included); "
        "OOM (>x): the allocation failed under the cap, so the method needs more than x MiB; "
        "a '<' ratio is an upper bound."
    )

    # Same objective: the opd and TRL values must agree to fp32 rounding.
    both = [n for n in arguments.sizes if results[n, "opd"]["status"] == "ok" and results[n, "trl"]["status"] == "ok"]
    if both:
        n = max(both)
        opd, trl = results[n, "opd"], results[n, "trl"]
        relative = _relative_difference
        print(
            f"opd vs TRL at N={n:,}: loss {opd['loss']:.8g} vs {trl['loss']:.8g} "
            f"(relative difference {relative(opd['loss'], trl['loss']):.1e}); "
            f"|grad hidden| rel. diff {relative(opd['grad_hidden_norm'], trl['grad_hidden_norm']):.1e}, "
            f"|grad W| rel. diff {relative(opd['grad_weight_norm'], trl['grad_weight_norm']):.1e}"
        )
    else:
        print("opd vs TRL: no size where both ran; loss values not compared")
    print(f"total run time {time.perf_counter() - started:.0f} s")

    largest = max(arguments.sizes)
    memory_ratio, time_ratio = _ratios(results[largest, "opd"], results[largest, "trl"])
    note = ""
    if results[largest, "trl"]["status"] == "oom":
        note = f" trl=oom@{arguments.cap_gib:g}GiB"
    elif results[largest, "trl"]["status"] != "ok":
        note = " trl=crashed"
    if results[largest, "opd"]["status"] != "ok":
        note += f" opd={results[largest, 'opd']['status']}"
    print(f"loss_memory opd/trl N={largest} peak_mem={memory_ratio} time={time_ratio}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        default="512,2048,8192",
        type=lambda text: [int(size) for size in text.split(",") if size.strip()],
        help="comma-separated token counts N (default 512,2048,8192)",
    )
    parser.add_argument(
        "--cap-gib",
        type=float,
        default=20.0,
        help="address-space cap per worker in GiB; keep it below the free RAM (default 20)",
    )
    parser.add_argument(
        "--chunk-rows",
        type=int,
        default=None,
        help="opd positions per chunk (default: opd's own, 128 MiB of logits per chunk)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per worker after the warm-up; min time and max peak are kept (default 1)",
    )
    parser.add_argument("--vocab", type=int, default=VOCAB, help=f"output layer rows V (default {VOCAB})")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size D (default {HIDDEN})")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    arguments = parse_arguments(parser, {"sizes": [64], "vocab": 2048, "hidden": 64, "cap_gib": 4.0})
    if arguments.worker:
        record = run_worker(
            arguments.worker,
            arguments.tokens,
            arguments.cap_gib,
            arguments.chunk_rows,
            arguments.repeats,
            arguments.vocab,
            arguments.hidden,
        )
        print(RESULT_PREFIX + json.dumps(record), flush=True)
    else:
        run_driver(arguments)


if __name__ == "__main__":
    main()
