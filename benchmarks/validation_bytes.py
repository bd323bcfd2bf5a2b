"""Bytes that one validation pass moves from the workers to the controller, on a 2-rank CPU cluster.

A private local Ray cluster runs the tiny distillation config with 2 FSDP2 trainer
ranks (teacher colocated, exact full-vocabulary KL) and 1 rollout worker. Every result
any worker group hands the controller during one ``validate`` call is pickled and
measured, by role; the table also gives the widest tensor seen (its last dimension),
so a ``[B, L, V]`` tensor shows as the vocabulary's width.

It uses only ``setup``, ``validate`` and ``WorkerGroup.gather``, so it measures older
versions of opd too (run it with that checkout first on ``PYTHONPATH``).

Usage: ``python benchmarks/validation_bytes.py [--prompts 8] [--batch-size 4] [--max-length 32]``
"""

from __future__ import annotations

import argparse
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distributed.workers.ray_cluster import RAY_ENVIRONMENT
from opd.distributed.workers.worker_group import WorkerGroup
from opd.run.validation import validate
from opd.utils.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic"


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if hasattr(value, "__dict__"):
        return tensors_in(vars(value))
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (2 prompts in 1 batch of 8 tokens)")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.batch_size, args.max_length = 2, 2, 8
    for key, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    workdir = Path(tempfile.mkdtemp(prefix="opd_validation_bytes_"))
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=str(workdir / "ray"), log_to_driver=False)
    config = load_config(
        MasterConfig,
        REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml",
        [
            f"output_dir={workdir / 'run'}",
            f"data.train_path={DATA / 'train.jsonl'}",
            f"data.val_path={DATA / 'val.jsonl'}",
            f"data.max_val_examples={args.prompts}",
            f"validation.batch_size={args.batch_size}",
            f"validation.generate_strategy.max_length={args.max_length}",
            "logger.console=false",
            "cluster.trainer.workers=2",
            "cluster.rollout.workers=1",
        ],
    )
    components = setup(config)
    received: dict[str, list[int]] = {}
    widest: dict[str, int] = {}
    gather = WorkerGroup.gather

    def measured(self: WorkerGroup, refs: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        results = gather(self, refs, *args, **kwargs)
        for result in results:
            received.setdefault(self.role, []).append(len(pickle.dumps(result)))
            widths = [tensor.shape[-1] for tensor in tensors_in(result) if tensor.dim() >= 3]
            widest[self.role] = max([widest.get(self.role, 0), *widths])
        return results

    WorkerGroup.gather = measured  # type: ignore[method-assign]
    try:
        metrics = validate(
            components.student_generation,
            components.student_policy,
            components.teacher_policy,
            components.val_dataloader,
            components.tokenizer,
            config.validation.generate_strategy,
            config.validation.teacher_topk,
            loss_request=components.loss_fn.teacher_request,
        )
    finally:
        WorkerGroup.gather = gather  # type: ignore[method-assign]
        components.close()
        ray.shutdown()
    batches = -(-args.prompts // args.batch_size)
    print(
        f"vocabulary {len(components.tokenizer)}, {args.prompts} prompts in {batches} batches, "
        f"val/kl_forward {metrics.get('val/kl_forward', float('nan')):.6f}"
    )
    print(f"{'role':<10} {'results':>8} {'bytes':>12} {'bytes/batch':>12} {'widest [.., .., W]':>19}")
    for role, sizes in sorted(received.items()):
        print(f"{role:<10} {len(sizes):>8} {sum(sizes):>12} {sum(sizes) // batches:>12} {widest.get(role, 0):>19}")


if __name__ == "__main__":
    main()
