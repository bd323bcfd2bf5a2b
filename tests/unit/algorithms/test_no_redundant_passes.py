"""Each optimizer step does the essential work once: one teacher forward and one student
forward/backward per sequence, the sampler's log-probs taken from generation (no second
student forward to score the samples), and nothing generated on fixed-data (λ = 0) steps.

Forward hooks on both models' decoders count what really runs, whatever the code path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opd.distillation.config import MasterConfig
from opd.distillation.setup import DistillationComponents, setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
STEPS, BATCH = 3, 4


def run_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    base = [
        f"output_dir={tmp_path / 'run'}", f"data.train_path={TRAIN_DATA}", "data.val_path=null",
        "validation.val_at_start=false", "validation.val_at_end=false", "checkpointing.enabled=false",
        "logger.console=false", f"training.batch_size={BATCH}", "training.micro_batch_size=2",
        f"training.max_num_steps={STEPS}", "distillation.generate_strategy.max_length=6",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


class PassCounter:
    """Counts decoder forward passes of one model, split by what was running."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = {"generation": 0, "with_grad": 0, "without_grad": 0}
        self.generating = False
        model.get_decoder().register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        kind = "generation" if self.generating else ("with_grad" if torch.is_grad_enabled() else "without_grad")
        self.calls[kind] += 1


def count_passes(parts: DistillationComponents) -> tuple[PassCounter, PassCounter]:
    student_policy, teacher_policy, generation = parts.student_policy, parts.teacher_policy, parts.student_generation
    student, teacher = PassCounter(student_policy.model), PassCounter(teacher_policy.model)
    original_generate = generation.generate

    def generate(*args, **kwargs):
        student.generating = True
        try:
            return original_generate(*args, **kwargs)
        finally:
            student.generating = False

    generation.generate = generate  # type: ignore[method-assign]
    return student, teacher


@pytest.mark.parametrize("fused", ["true", "false"])
@pytest.mark.parametrize("loss_type", ["full_vocab", "sampled_token"])
def test_on_policy_step_runs_each_model_once_per_micro_batch(tmp_path, fused, loss_type):
    parts = setup(run_config(tmp_path, "distillation.lambda=1.0", "distillation.num_samples_per_prompt=2",
                             f"loss_fn.fused_lm_head={fused}", f"loss_fn.type={loss_type}"))
    student, teacher = count_passes(parts)
    distillation_train(parts)
    micro_batches = STEPS * BATCH * 2 // 2  # two samples per prompt, two sequences per micro-batch
    # The student: one training forward per micro-batch (its backward follows), no
    # gradient-free re-scoring of its own samples; the rest is generation.
    assert student.calls["with_grad"] == micro_batches
    assert student.calls["without_grad"] == 0
    assert student.calls["generation"] > 0
    # The teacher, never with gradients: each micro-batch holds the two samples of one prompt,
    # so its shared-prompt forward (teacher.share_prompt_forward, the default) runs twice: once
    # over the prompt, once over both responses on the prompt's cache.
    assert teacher.calls == {"generation": 0, "with_grad": 0, "without_grad": 2 * micro_batches}


def test_without_prompt_sharing_the_teacher_runs_once_per_micro_batch(tmp_path):
    parts = setup(run_config(tmp_path, "distillation.lambda=1.0", "distillation.num_samples_per_prompt=2",
                             "teacher.share_prompt_forward=false"))
    _, teacher = count_passes(parts)
    distillation_train(parts)
    assert teacher.calls == {"generation": 0, "with_grad": 0, "without_grad": STEPS * BATCH * 2 // 2}


def test_fixed_data_steps_generate_nothing(tmp_path):
    parts = setup(run_config(tmp_path, "distillation.lambda=0.0", "distillation.num_samples_per_prompt=2"))
    student, teacher = count_passes(parts)
    distillation_train(parts)
    micro_batches = STEPS * BATCH // 2  # fixed data: one sequence per prompt, whatever the sample count
    assert student.calls == {"generation": 0, "with_grad": micro_batches, "without_grad": 0}
    assert teacher.calls == {"generation": 0, "with_grad": 0, "without_grad": micro_batches}
