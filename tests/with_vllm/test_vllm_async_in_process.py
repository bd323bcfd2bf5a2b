"""An asynchronous schedule with the in-process vLLM engine equals it with the in-process HF engine.

Both engines hold their own copy of the weights, refit from the student when the
schedule says (one or two steps behind), so with greedy rollouts in float32 the two runs
sample the same tokens and train the same steps: the per-step losses agree, and the
samples are as stale as the schedule makes them.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")

from opd_test_helpers import TINY_TRAIN_DATA

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config

TINY = "examples/configs/distillation_tiny.yaml"


def steps(tmp_path, scheduler: str, backend: str) -> list[dict]:
    output = tmp_path / f"{scheduler}-{backend}"
    overrides = [
        f"output_dir={output}",
        f"data.train_path={TINY_TRAIN_DATA}",
        "data.val_path=null",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "logger.console=false",
        "model.student_model_path=tiny:demo-student",  # vLLM's CPU attention needs 32-dimensional heads
        "loss_fn.type=topk",
        f"training.scheduler={scheduler}",
        "training.max_num_steps=3",
        "training.batch_size=2",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=8",
        f"generation.backend={backend}",
    ]
    components = setup(load_config(MasterConfig, TINY, overrides))
    try:
        distillation_train(components)
    finally:
        components.close()
    records = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "train/loss" in record]


@pytest.mark.parametrize("scheduler, lag", [("one_step_off", 1), ("two_step_off", 2)])
def test_vllm_in_process_follows_the_schedule_as_the_hf_engine_does(tmp_path, scheduler, lag):
    with_vllm, with_hf = steps(tmp_path, scheduler, "vllm"), steps(tmp_path, scheduler, "hf")
    assert [record["train/staleness_max"] for record in with_vllm] == [min(step, lag) for step in range(3)]
    for mine, reference in zip(with_vllm, with_hf, strict=True):
        assert math.isclose(mine["train/loss"], reference["train/loss"], rel_tol=1e-4), (mine, reference)
