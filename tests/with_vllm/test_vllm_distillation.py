"""A distillation run with ``generation.backend=vllm`` against the same run with the HF backend.

Greedy rollouts, so both runs see the same tokens: the per-step losses must agree, and
the vLLM run must refit before each rollout. (Its own module: one vLLM engine per
process at a time, and the generation tests' engine is closed before this one opens.)
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")


from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.vllm_generation import VllmGeneration
from opd.utils.config import load_config

DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"


def test_distillation_with_vllm_rollouts_equals_the_hf_backend_run(tmp_path, task_dir):
    common = [
        f"data.train_path={task_dir / 'train.jsonl'}", f"data.val_path={task_dir / 'val.jsonl'}",
        "validation.val_at_start=false", "checkpointing.enabled=false", "logger.console=false",
        "logger.progress_bar=false", "training.batch_size=4", "training.micro_batch_size=4",
        "training.max_num_steps=3", "distillation.generate_strategy.max_length=32",
        "validation.generate_strategy.max_length=32", "data.max_val_examples=8",
    ]
    records = {}
    for backend in ("hf", "vllm"):
        config = load_config(MasterConfig, DEMO_CONFIG, common + [f"output_dir={tmp_path / backend}",
                                                                   f"generation.backend={backend}"])
        parts = setup(config)
        assert isinstance(parts.student_generation, VllmGeneration if backend == "vllm" else HFGeneration)
        try:
            distillation_train(parts)
        finally:
            parts.close()  # closes the vLLM engine (a no-op for the HF backend)
        lines = (tmp_path / backend / "logs" / "metrics.jsonl").read_text().splitlines()
        records[backend] = [json.loads(line) for line in lines]
    losses = {name: [r["train/loss"] for r in rows if "train/loss" in r] for name, rows in records.items()}
    assert len(losses["vllm"]) == 3
    assert losses["vllm"] == pytest.approx(losses["hf"], rel=1e-4, abs=1e-6)
    assert sum("timing/refit" in r for r in records["vllm"]) == 3  # stale before every rollout
    assert not any("timing/refit" in r for r in records["hf"])
    # the end-of-run validation samples with the refit engine: same answers as the HF run's
    final = {name: next(r for r in reversed(rows) if "val/kl_forward" in r) for name, rows in records.items()}
    assert final["vllm"]["val/kl_forward"] == pytest.approx(final["hf"]["val/kl_forward"], rel=1e-4)
    assert final["vllm"]["val/mean_response_length"] == final["hf"]["val/mean_response_length"]
