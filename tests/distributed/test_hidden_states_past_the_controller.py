"""A teacher pool's hidden states never pass through the controller: they go from the pool to the trainer ranks.

The teacher has a large hidden size (4,096, no decoder layers, so its forward costs nothing) and the fixed data long
responses, so each step's final hidden states are about 80 MB (``[8, ~620, 4096]`` float32). Two steps of the exact
loss (``full_vocab``, λ = 0) on a cluster with a teacher pool run twice: as opd runs them, the pool workers leave
the states in Ray's object store and the trainer rank that binds them fetches them; and, for contrast, with the
states sent through the controller (``TeacherPool.hidden_states_in_store = False``, what opd did before). The
controller's resident memory is sampled through each run; its peak above the level before training must stay
under a quarter of one step's hidden states in the first run, and reach at least one step's worth in the second
(the measurement can see what it guards against). Both runs' losses are equal.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, short_run_overrides
from transformers import Qwen2Config, Qwen2ForCausalLM

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.distributed.teacher_pool import TeacherPool
from opd.models.tiny import build_tiny_tokenizer
from opd.run.plotting import read_metrics
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
HIDDEN = 4096
ROWS = 8
RESPONSE_CHARS = 600


@pytest.fixture(scope="module")
def wide_teacher(tmp_path_factory) -> Path:
    """A teacher of the tiny tokenizer with a 4,096-wide hidden state and no decoder layers."""
    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=0,
        num_attention_heads=32, num_key_value_heads=1, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("wide_teacher")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _long_rows(path: Path) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Count from {index}."},
                {"role": "assistant", "content": " ".join(str(index + step) for step in range(400))[:RESPONSE_CHARS]},
            ]
        }
        for index in range(ROWS)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(tmp_path: Path, name: str, teacher: Path) -> tuple[int, list[float]]:
    """The controller's peak resident memory above its level before training, and the run's losses."""
    config = load_config(MasterConfig, TINY, [
        *short_run_overrides(tmp_path, name), f"data.train_path={_long_rows(tmp_path / f'{name}.jsonl')}",
        f"model.teacher_model_path={teacher}", "distillation.lambda=0.0", "data.max_prompt_length=64",
        "training.max_num_steps=2", f"training.batch_size={ROWS}", "training.micro_batch_size=2",
        "training.save_freq=0", "checkpointing.enabled=false", "training.warmup_steps=0",
        "loss_fn.type=full_vocab", "loss_fn.compile_kernels=false",
        "cluster.trainer.workers=1", "cluster.rollout.workers=1",
        "cluster.teacher.placement=pool", "cluster.teacher.workers=1",
    ])  # fmt: skip
    components = setup(config)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _resident_bytes())
            time.sleep(0.002)

    before = _resident_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        distillation_train(components)
    finally:
        stop.set()
        sampler.join()
        components.close()
    losses = [
        record["train/loss"] for record in read_metrics(Path(config.output_dir) / "logs") if "train/loss" in record
    ]
    return peak[0] - before, losses


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the controller's memory from /proc (Linux)")
def test_hidden_states_go_from_the_pool_to_the_trainer_ranks_not_through_the_controller(
    ray_cluster, tmp_path, wide_teacher, monkeypatch
):
    tokens_per_step = ROWS * (RESPONSE_CHARS + 20)  # bytes of the tiny tokenizer: one token each, prompts included
    step_bytes = tokens_per_step * HIDDEN * 4
    in_store, losses = _run(tmp_path, "in_store", wide_teacher)
    monkeypatch.setattr(TeacherPool, "hidden_states_in_store", False)
    through_controller, reference_losses = _run(tmp_path, "through_controller", wide_teacher)
    mib = 2**20
    print(
    print(  # seen with -s: the figures the guide quotes
        f"controller growth: in store {in_store / mib:.1f} MiB, through the controller "
        f"{through_controller / mib:.1f} MiB, one step {step_bytes / mib:.1f} MiB"
    )
    )
    assert through_controller >= step_bytes, (
        f"the contrast run's controller grew by {through_controller / mib:.0f} MiB, less than one step's hidden "
        f"states ({step_bytes / mib:.0f} MiB): the measurement cannot see them"
    )
    assert in_store < step_bytes / 4, (
        f"the controller grew by {in_store / mib:.0f} MiB; one step's hidden states are {step_bytes / mib:.0f} MiB"
    )
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert losses == reference_losses  # the same states, fetched by the rank instead of sent to it
