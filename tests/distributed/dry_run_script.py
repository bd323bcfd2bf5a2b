"""Runs one dry-run rank of the tiny pair in a process of its own and prints its memory as JSON.

``python dry_run_script.py clean`` runs opd's trainer as it is; ``planted`` first puts
back the defect of commit c206a4c's parent: the metrics all-reduced as a host tensor
(NCCL has no CPU backend); ``chunks`` runs it twice with loss chunks of 64 positions over
200-position responses, as ``opd plan`` traces them (the first two chunks and the last) and
with every chunk, and prints both memories with the number of chunks each loss call ran.
The dry run registers a stand-in accelerator for its whole
process, hence a process of its own (see :mod:`opd.plan.dry_run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from opd.distillation.config import MasterConfig
from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.kernels import fused_lm_head
from opd.models.tiny import build_tiny_tokenizer
from opd.plan import rank_trace
from opd.plan.dry_run import StepShape, dry_run_rank
from opd.plan.fake_device import DeviceMismatchError
from opd.utils.config import load_config


def _sum_over_ranks_on_the_host(self, totals):
    """``TrainerWorker._sum_over_ranks`` before c206a4c: the values all-reduced as a CPU tensor.

    (The planted tensor holds zeros: the metrics themselves are device tensors now, which the stand-in accelerator
    cannot read, and the defect is where the collective's tensor lives, not what it holds.)
    """
    reduced = {}
    for op, keys in ((dist.ReduceOp.SUM, [k for k in sorted(totals) if not k.endswith("_max")]),):
        values = torch.zeros(len(keys), dtype=torch.float64)
        dist.all_reduce(values, op=op)
        reduced.update(zip(keys, values.tolist(), strict=True))
    return reduced


def chunk_traces(config_path: str) -> dict:
    """The rank's memory traced with the first two loss chunks and the last, then with every chunk."""
    config = load_config(MasterConfig, config_path, ["loss_fn.compile_kernels=false", "loss_fn.chunk_size=64"])
    vocab = len(build_tiny_tokenizer())
    spec = TrainerSpec("tiny:student", "tiny:teacher", config.model, config.training, 1, "nccl", 60, 1)
    chunks_run: list[int] = []
    every_start = fused_lm_head.chunk_starts

    def counted(rows: int, chunk_rows: int) -> list[int]:
        starts = every_start(rows, chunk_rows)
        chunks_run.append(len(starts))
        return starts

    fused_lm_head.chunk_starts = counted
    result = {}
    for name in ("alike_once", "every_chunk"):
        if name == "every_chunk":
            rank_trace.alike_chunks_traced_once = contextlib.nullcontext  # type: ignore[assignment]
        memory = dry_run_rank(spec, 2, 0, StepShape(2, 6, 200), config.loss_fn.build(vocab, "cpu"), vocab)
        result[name] = {"memory": dataclasses.asdict(memory), "chunks_per_call": sorted(set(chunks_run))}
        chunks_run.clear()
    return result


def main(mode: str, config_path: str) -> None:
    if mode == "chunks":
        print(json.dumps(chunk_traces(config_path)))
        return
    if mode == "planted":
        TrainerWorker._sum_over_ranks = _sum_over_ranks_on_the_host
    config = load_config(MasterConfig, config_path, ["loss_fn.compile_kernels=false"])
    vocab = len(build_tiny_tokenizer())
    spec = TrainerSpec("tiny:student", "tiny:teacher", config.model, config.training, 1, "nccl", 60, 1)
    try:
        memory = dry_run_rank(spec, 2, 0, StepShape(2, 6, 10), config.loss_fn.build(vocab, "cpu"), vocab)
    except DeviceMismatchError as error:
        print(json.dumps({"error": str(error)}))
        return
    print(json.dumps(dataclasses.asdict(memory)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
