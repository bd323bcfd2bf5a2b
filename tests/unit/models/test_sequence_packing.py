"""Sequence packing: the padding-free layout, the models' outputs on it, and one optimizer
step that gives the same loss and gradients as the padded batch."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_padding_free, pack_sequences, shift_token_mask
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[3]
LENGTHS, PROMPTS = [6, 13, 2, 9, 11], [2, 5, 1, 9, 4]  # one sequence that is all prompt


def padded_batch(mask_prompt_tokens: bool = True) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(3, 120, (n,), generator=generator).tolist() for n in LENGTHS]
    return pack_sequences(sequences, PROMPTS, 0, mask_prompt_tokens)


@pytest.mark.parametrize("mask_prompt_tokens", [True, False])
def test_packed_layout(mask_prompt_tokens):
    batch = padded_batch(mask_prompt_tokens)
    packed = pack_padding_free(batch)
    total = sum(LENGTHS)
    assert packed.size == 1 and packed["input_ids"].shape == (1, total)
    assert packed["input_lengths"].tolist() == [total]
    assert packed["sequence_lengths"].tolist() == [LENGTHS]
    start = 0
    for row, length in enumerate(LENGTHS):
        assert packed["input_ids"][0, start:start + length].tolist() == batch["input_ids"][row, :length].tolist()
        assert packed["position_ids"][0, start:start + length].tolist() == list(range(length))
        assert packed["token_mask"][0, start] == 0  # nothing real predicts a sequence's first token
        assert packed["token_mask"][0, start + 1:start + length].tolist() == batch["token_mask"][row, 1:length].tolist()
        start += length
    # Exactly the same loss positions.
    assert int(shift_token_mask(packed["token_mask"]).sum()) == int(shift_token_mask(batch["token_mask"]).sum())


def test_models_see_each_packed_sequence_alone():
    batch = padded_batch()
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    padded_logits = teacher.get_logits(batch)
    packed_logits = teacher.get_logits(pack_padding_free(batch))
    start = 0
    for row, length in enumerate(LENGTHS):
        torch.testing.assert_close(packed_logits[0, start:start + length], padded_logits[row, :length],
                                   rtol=1e-10, atol=1e-10)
        start += length


def one_step(batch, loss_fn, packing, micro_batch_size=2, micro_batch_tokens=None):
    model = build_tiny_model("student", dtype=torch.float64)
    policy = HFPolicy(model, OptimizerConfig(learning_rate=1e-3, max_grad_norm=None), micro_batch_size, 1,
                      micro_batch_tokens=micro_batch_tokens, sequence_packing=packing)
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    policy.optimizer.register_step_pre_hook(lambda opt, *_: grads.update(
        {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}))
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    metrics = policy.train(batch, loss_fn,
                           teacher_signal=functools.partial(teacher.score, request=loss_fn.teacher_request))
    return metrics, grads


def assert_packed_step_equals_padded_step(batch, loss_fn, batching) -> None:
    """Same metrics and gradients, to float64 rounding, packed (with ``batching``) as padded."""
    reference_metrics, reference_grads = one_step(batch, loss_fn, packing=False)
    metrics, grads = one_step(batch, loss_fn, packing=True, **batching)
    assert reference_metrics["grad_norm"] > 1e-4
    for key, value in reference_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize(("loss_class", "options"), [
    (KLLossFn, {"kl_type": "mixed"}),
    (KLLossFn, {"kl_type": "reverse", "fused_lm_head": True}),
    (JSDLossFn, {"beta": 0.4, "fused_lm_head": True, "kl_reduction": "sum"}),
    (TopKKLLossFn, {"k": 5, "kl_type": "forward", "fused_lm_head": True}),
], ids=["kl", "kl-fused", "jsd-fused-sum", "topk-fused"])
@pytest.mark.parametrize("batching", [{"micro_batch_size": 2}, {"micro_batch_size": 5},
                                      {"micro_batch_tokens": 30}], ids=["mbs2", "mbs5", "tokens30"])
def test_packed_step_equals_padded_step(loss_class, options, batching):
    batch = padded_batch()
    loss_fn = loss_class(temperature=1.3, **options)
    assert_packed_step_equals_padded_step(batch, loss_fn, batching)


@pytest.mark.parametrize("options", [
    {"discount": 0.0, "clip_ratio": 0.2},
    {"discount": 0.8, "adv_tau": 0.5, "clip_ratio": None},
    {"discount": 1.0, "adv_tau": 1.0, "student_tau": 0.5, "clip_ratio": 0.1, "fused_lm_head": True},
], ids=["no-discount", "discount-reward", "full-discount-fused"])
@pytest.mark.parametrize("batching", [{"micro_batch_size": 2}, {"micro_batch_size": 5},
                                      {"micro_batch_tokens": 30}], ids=["mbs2", "mbs5", "tokens30"])
def test_packed_sampled_token_step_equals_padded_step(options, batching):
    # The discounted advantages run along a sequence: packed, they must stop at each
    # sequence's end instead of collecting the next sequence's tokens.
    batch = padded_batch()
    # Sampler log-probs near the student's own (as on-policy), so that importance ratios
    # sit on both sides of the clip range and gradients flow.
    with torch.no_grad():
        logits = build_tiny_model("student", dtype=torch.float64)(batch["input_ids"]).logits
    own = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    generator = torch.Generator().manual_seed(6)
    noise = 0.3 * torch.randn(own.shape, generator=generator, dtype=torch.float64)
    batch["generation_logprobs"] = torch.nn.functional.pad(own + noise, (1, 0)) * batch["token_mask"]
    batch["task_reward"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    loss_fn = SampledTokenLossFn(**options)
    assert_packed_step_equals_padded_step(batch, loss_fn, batching)


def test_packed_layout_carries_segments_and_per_token_rewards():
    batch = padded_batch()
    batch["task_reward"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    packed = pack_padding_free(batch)
    expected_segments = [index for index, length in enumerate(LENGTHS) for _ in range(length)]
    assert packed["segment_ids"][0].tolist() == expected_segments
    assert packed["task_reward"][0].tolist() == [float(batch["task_reward"][s]) for s in expected_segments]


def run_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    base = [
        f"output_dir={tmp_path / 'run'}", f"data.train_path={REPO_ROOT / 'examples/data/tiny_arithmetic/train.jsonl'}",
        "data.val_path=null", "validation.val_at_start=false", "validation.val_at_end=false",
        "checkpointing.enabled=false", "logger.console=false", "training.batch_size=3",
        "training.micro_batch_size=null", "training.max_num_steps=2", "distillation.generate_strategy.max_length=8",
    ]
    return load_config(MasterConfig, REPO_ROOT / "examples/configs/distillation_tiny.yaml", base + list(overrides))


def test_packed_run_logs_the_padded_run_losses(tmp_path):
    losses = {}
    for packing in ("false", "true"):
        config = run_config(tmp_path / packing, f"training.sequence_packing={packing}")
        distillation_train(setup(config))
        lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
        losses[packing] = [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]
    assert len(losses["true"]) == 2
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4)


def test_packed_sampled_token_run_logs_the_padded_run_losses(tmp_path):
    losses = {}
    for packing in ("false", "true"):
        config = run_config(tmp_path / packing, f"training.sequence_packing={packing}", "loss_fn.type=sampled_token",
                            "loss_fn.discount=0.9", "distillation.generate_strategy.decoding_method=greedy",
                            "distillation.num_samples_per_prompt=1")
        distillation_train(setup(config))
        lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
        losses[packing] = [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]
    assert len(losses["true"]) == 2
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-4)


CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "installed", "expected"),
    [
        ("auto", CUDA, torch.bfloat16, True, "flash_attention_2"),
        ("auto", CUDA, torch.float16, True, "flash_attention_2"),
        ("auto", CUDA, torch.float32, True, None),  # flash attention has no fp32 kernel
        ("auto", CUDA, torch.bfloat16, False, None),  # the stated fallback: transformers' default (sdpa)
        ("auto", CPU, torch.bfloat16, True, None),
        ("sdpa", CUDA, torch.bfloat16, True, "sdpa"),
        ("eager", CPU, torch.float32, False, "eager"),
        (None, CUDA, torch.bfloat16, True, None),
    ],
)
def test_auto_attention_is_flash_attention_where_it_can_run(requested, device, dtype, installed, expected):
    from opd.models.loading import attention_implementation

    asked = []

    def flash_attn_installed() -> bool:
        asked.append(True)
        return installed

    assert attention_implementation(requested, device, dtype, flash_attn_installed) == expected
    if device.type == "cpu" or requested != "auto":
        assert not asked  # the package is looked for only where it could run


@pytest.mark.parametrize(("requested", "loaded"), [("auto", "sdpa"), ("eager", "eager")])
def test_a_model_on_cpu_loads_with_the_resolved_attention(tmp_path, requested, loaded):
    from opd.models.config import ModelLoadingConfig
    from opd.models.loading import load_causal_lm

    build_tiny_model("student").save_pretrained(tmp_path / "student")
    model = load_causal_lm(
        str(tmp_path / "student"), torch.float32, CPU, ModelLoadingConfig(attn_implementation=requested)
    )
    assert model.config._attn_implementation == loaded
