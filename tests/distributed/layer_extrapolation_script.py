"""Dry-runs deep narrow models twice, traced whole and extrapolated from 3 and 4 layers; prints both as JSON.

``python layer_extrapolation_script.py DIR`` writes a 6-layer student and a 7-layer teacher
(Qwen2, a few dozen wide) under ``DIR`` and prints one JSON object: case name → the
figures of each way (``every_layer`` and ``extrapolated``) and the depths each way traced.
A dry run registers a stand-in accelerator for its whole process, hence a process of its
own (see :mod:`opd.plan.dry_run`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config

from opd.distillation.config import MasterConfig
from opd.distributed.trainer_worker import TrainerSpec
from opd.models.config import LoraConfig
from opd.models.interfaces import FullVocabRequest
from opd.models.tiny import build_tiny_tokenizer
from opd.plan import dry_run, fake_step
from opd.plan.dry_run import StepShape
from opd.utils.config import load_config

STUDENT_LAYERS, TEACHER_LAYERS = 7, 7
# Widths at which the colocated case's peak moves with depth: at 3 and 4 student layers it
# is in the teacher's forward (a wide gathered layer), at 7 in the student's backward.
STUDENT_MLP, TEACHER_MLP = 1024, 3072
TINY = Path(__file__).resolve().parents[2] / "examples" / "configs" / "distillation_tiny.yaml"


def _write_model(directory: Path, layers: int, hidden: int, heads: int, intermediate: int, vocab: int) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        intermediate_size=intermediate,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ).save_pretrained(directory)
    return str(directory)


def _depths_traced() -> list[dict[str, int]]:
    """Wraps the dry run's one-trace functions to log the depths each trace cut its models to."""
    traced: list[dict[str, int]] = []
    for name in ("trace_rank", "trace_teacher_replica"):
        original = getattr(dry_run, name)

        def logged(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            traced.append(dict(fake_step.LAYER_DEPTHS))
            return _original(*args, **kwargs)

        setattr(dry_run, name, logged)
    return traced


def main(directory: str) -> None:
    vocab = len(build_tiny_tokenizer())
    student = _write_model(Path(directory) / "student", STUDENT_LAYERS, 64, 4, STUDENT_MLP, vocab)
    teacher = _write_model(Path(directory) / "teacher", TEACHER_LAYERS, 96, 6, TEACHER_MLP, vocab)
    config = load_config(MasterConfig, str(TINY), ["loss_fn.compile_kernels=false"])
    full_vocab = config.loss_fn.build(vocab, "cpu")
    common = (config.model, config.training, 1, "nccl", 60, 1)
    ranks = {
        # name: (spec, world, rank, micro-batches, loss)
        "colocated_two_micro_batches": (TrainerSpec(student, teacher, *common), 4, 0, 2, full_vocab),
        "checkpointing_hsdp_lora_teacher_apart": (
            TrainerSpec(
                student,
                None,
                *common,
                teacher_head_path=teacher,
                lora=LoraConfig(r=4),
                activation_checkpointing=True,
                shard_group_size=2,
            ),
            4,
            1,
            1,
            full_vocab,
        ),
        "whole_teacher_uneven_last_rank": (
            TrainerSpec(
                student,
                teacher,
                *common,
                teacher_sharded=False,
                reshard_after_forward=False,
            ),
            3,
            2,
            2,
            full_vocab,
        ),
    }
    results: dict[str, Any] = {}
    traced = _depths_traced()
    for name, (spec, world, rank, micro_batches, loss) in ranks.items():
        shape = StepShape(2, 12, 20, micro_batches=micro_batches)
        results[name] = {}
        for way, every_layer in (("every_layer", True), ("extrapolated", False)):
            traced.clear()
            memory = dry_run.dry_run_rank(spec, world, rank, shape, loss, vocab, 96, every_layer=every_layer)
            results[name][way] = {"memory": dataclasses.asdict(memory), "traced": list(traced)}
    replicas = {"replica_sharded_hidden_states": (2, FullVocabRequest())}
    for name, (shards, request) in replicas.items():
        results[name] = {}
        for way, every_layer in (("every_layer", True), ("extrapolated", False)):
            traced.clear()
            memory = dry_run.dry_run_teacher_replica(
                teacher, torch.float32, shards, StepShape(2, 12, 20), request, every_layer=every_layer
            )
            results[name][way] = {"memory": dataclasses.asdict(memory), "traced": list(traced)}
    print(json.dumps({"student": student, "teacher": teacher, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1])
