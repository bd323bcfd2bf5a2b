"""The dry run's predicted peak memory against the peak of the same step run for real on CPU.

``opd plan`` predicts a trainer rank's peak from fake tensors
(:func:`opd.plan.dry_run.dry_run_rank`, through FSDPMemTracker). This script runs the
same step for real, on CPU, and measures its peak independently of the tracker: the
process's resident memory high-water mark (``VmHWM``, reset just before the step through
``/proc/self/clear_refs``) above its resident memory before the models were built. The
models are made large enough (a few hundred MB of weights, Adam moments and activations)
that tensors dominate what the process holds.

Cases: one rank in process (a process group of one), and each rank of a 2-rank FSDP2 run
over gloo. Both use the real trainer (:class:`~opd.distributed.trainer_worker.TrainerWorker`)
with a colocated, sharded teacher, the exact fused full-vocabulary loss, fp32 weights and
compute, two micro-batches, and Adam's moments already in place (the steady state). The
dry run of each case runs in a process of its own, as ``opd plan`` does.

Large allocations are made with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so that memory freed
in the step goes back to the system and the high-water mark is the tensors' own peak.

    python benchmarks/dry_run_accuracy.py            # the table
    python benchmarks/dry_run_accuracy.py --json     # and one JSON line per case
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import REPO, parse_arguments

MIB = 1024**2
SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "student": (512, 1536, 4, 8, 2, 32_000),
    "teacher": (768, 2048, 4, 12, 4, 32_000),
}
SMOKE_SIZES = {"student": (128, 384, 2, 4, 2, 8_000), "teacher": (192, 512, 2, 4, 2, 8_000)}


def _write_models(directory: Path, sizes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Random Qwen2 models of ``sizes`` saved as model directories (the real run loads them)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    paths = {}
    for name, (hidden, intermediate, layers, heads, kv_heads, vocab) in sizes.items():
        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            tie_word_embeddings=name == "student",
            max_position_embeddings=4096,
        )
        torch.manual_seed(0)
        path = directory / name
        Qwen2ForCausalLM(config).save_pretrained(str(path))
        paths[name] = str(path)
    return paths


def _spec(paths: dict[str, str], vocab: int) -> tuple[Any, Any]:
    """The trainer's spec and loss for the saved models (imported here: the parent process stays light)."""
    from opd.distillation.config import MasterConfig
    from opd.distributed.trainer_worker import TrainerSpec
    from opd.utils.config import load_config

    config = load_config(
        MasterConfig,
        REPO / "examples" / "configs" / "distillation_tiny.yaml",
        ["loss_fn.compile_kernels=false", "training.adam_implementation=fused"],
    )
    spec = TrainerSpec(paths["student"], paths["teacher"], config.model, config.training, 10, "gloo", 300, 1)
    return spec, config.loss_fn.build(vocab, "cpu")


def _shape(rows: int, prompt: int, response: int):
    from opd.plan.dry_run import StepShape

    return StepShape(rows, prompt, response, micro_batches=2)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_rank(rank: int, world: int, port: int, paths: dict[str, str], vocab: int, shape: Any) -> int:
    """Runs one real steady-state step of rank ``rank``; returns its peak resident bytes above the baseline."""
    import ctypes
    import gc

    import torch

    from opd.distributed.fsdp import init_process_group
    from opd.distributed.trainer_worker import TrainerWorker
    from opd.models.interfaces import AnsweredWhereTrained
    from opd.plan.fake_step import planned_micro_batch
    from opd.plan.rank_trace import adam_state_in_place

    torch.set_num_threads(1)
    spec, loss_fn = _spec(paths, vocab)
    mesh = init_process_group(rank, world, "127.0.0.1", port, "gloo", 300)
    micro_batch = planned_micro_batch(shape, vocab)
    gc.collect()
    baseline = _rss_kib("VmRSS") * 1024
    worker = TrainerWorker(rank, world, spec)
    worker.build(mesh, torch.device("cpu"))
    adam_state_in_place(worker)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    rows = world * shape.micro_batches * shape.micro_batch_size
    # The colocated teacher answers in the worker, as the driver's facade asks it to.
    signals = [AnsweredWhereTrained(loss_fn.teacher_request)] * shape.micro_batches
    worker.train(loss_fn, rows * shape.response_tokens, rows, [micro_batch] * shape.micro_batches, signals)
    peak = _rss_kib("VmHWM") * 1024 - baseline
    worker.shutdown()
    return peak


def predict_rank(rank: int, world: int, paths: dict[str, str], vocab: int, shape: Any) -> dict:
    """The dry run of the same rank: its peak and its standing part."""
    from opd.plan.dry_run import dry_run_rank

    spec, loss_fn = _spec(paths, vocab)
    memory = dry_run_rank(spec, world, rank, shape, loss_fn, vocab)
    return {"peak": memory.peak, "standing": memory.standing}


def _child(arguments: argparse.Namespace) -> None:
    paths = json.loads(arguments.paths)
    shape = _shape(arguments.rows, arguments.prompt, arguments.response)
    rank, world, vocab = arguments.rank, arguments.world, arguments.vocab
    if arguments.child == "measure":
        result: dict = {"peak": measure_rank(rank, world, arguments.port, paths, vocab, shape)}
    else:
        result = predict_rank(rank, world, paths, vocab, shape)
    print(json.dumps(result))


def _run_child(kind: str, rank: int, world: int, port: int, paths: dict[str, str], arguments: argparse.Namespace):
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",  # big blocks come from mmap and go back when freed
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, __file__, "--child", kind, "--rank", str(rank), "--world", str(world), "--port", str(port),
        "--paths", json.dumps(paths), "--rows", str(arguments.rows), "--prompt", str(arguments.prompt),
        "--response", str(arguments.response), "--vocab", str(arguments.vocab),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=900)
    if process.returncode != 0:
        raise RuntimeError(f"a child failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def compare(arguments: argparse.Namespace, paths: dict[str, str]) -> list[dict]:
    """Every case: prediction, measurement and error."""
    from opd.distributed.workers.ray_cluster import free_port

    rows = []
    for world in arguments.worlds:
        port = free_port()
        measured = [_result(p) for p in [_run_child("measure", r, world, port, paths, arguments) for r in range(world)]]
        for rank in range(world):
            predicted = _result(_run_child("predict", rank, world, 0, paths, arguments))
            error = (predicted["peak"] - measured[rank]["peak"]) / measured[rank]["peak"]
            rows.append(
                {
                    "case": "in process" if world == 1 else f"2-rank FSDP2 (gloo), rank {rank}",
                    "predicted": predicted["peak"],
                    "measured": measured[rank]["peak"],
                    "error": error,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--response", type=int, default=384, help="response tokens per row (they carry loss)")
    parser.add_argument(
        "--worlds",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2],
        help="comma-separated world sizes to run (1: in process; 2: the 2-rank FSDP2 run)",
    )
    parser.add_argument("--json", action="store_true", help="also print one JSON line per case")
    # Internal: one measurement or prediction in a process of its own.
    parser.add_argument("--child", choices=["measure", "predict"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=SIZES["student"][-1], help=argparse.SUPPRESS)
    arguments = parse_arguments(parser, {"rows": 1, "prompt": 32, "response": 64, "worlds": [1]}, argv)
    if arguments.child:
        _child(arguments)
        return []
    sizes = SMOKE_SIZES if arguments.smoke else SIZES
    arguments.vocab = sizes["student"][-1]
    with tempfile.TemporaryDirectory() as directory:
        paths = _write_models(Path(directory), sizes)
        rows = compare(arguments, paths)
    print(f"peak memory of one steady-state training step: dry run (fake tensors) vs measured (peak RSS), "
          f"micro-batches of {arguments.rows} × ({arguments.prompt} + {arguments.response}) tokens")  # fmt: skip
    print(f"{'case':<34}{'predicted MiB':>15}{'measured MiB':>15}{'error':>9}")
    for row in rows:
        print(f"{row['case']:<34}{row['predicted'] / MIB:>15.1f}{row['measured'] / MIB:>15.1f}{row['error']:>+9.1%}")
        if arguments.json:
            print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
