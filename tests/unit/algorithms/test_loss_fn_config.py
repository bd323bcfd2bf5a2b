"""The ``loss_fn:`` config section: its checks, the loss it builds, its metrics, and short
real runs with each teacher signal (the schema itself: ``test_loss_config.py``).

Reference values are computed here in float64 from first principles (softmax, top-k sets,
advantages), sharing no code with the loss functions under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import DistillationLossFn, JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.hybrid_loss import FullVocabHybridLossFn
from opd.losses.sampled_token import SampledTokenLossFn
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"


def run_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    """A few fast on-policy steps on the tiny models: no validation, no checkpoints."""
    base = [
        f"output_dir={tmp_path / 'run'}", f"data.train_path={TRAIN_DATA}", "data.val_path=null",
        "validation.val_at_start=false", "validation.val_at_end=false", "checkpointing.enabled=false",
        "logger.console=false", "training.batch_size=2", "training.micro_batch_size=1",
        "training.warmup_steps=0", "training.max_num_steps=3", "distillation.generate_strategy.max_length=8",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def train_records(config: MasterConfig) -> list[dict]:
    lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train/on_policy" in record]


# --------------------------------------------------------------------------- checks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss_fn.type=sampled_token", "distillation.lambda=0.5"], r"distillation\.lambda = 0\.5"),
        # The sampled-token loss works at the sampler's temperature: it has no temperature
        # key, so a temperature is refused naming the objectives that have one.
        (["loss_fn.type=sampled_token", "loss_fn.temperature=2.0"],
         r"unknown key 'loss_fn\.temperature' \(temperature belongs to loss_fn\.type = full_vocab / jsd / topk, "
         r"not sampled_token\)"),
        (["loss_fn.type=sampled_token", "distillation.kl_temperature=2.0"],
         r"config key 'distillation\.kl_temperature' has moved: it is now loss_fn\.temperature"),
        # The JSD needs the full vocabulary: the top-k objective has no beta, and the JSD is
        # its own loss_fn.type.
        (["loss_fn.type=topk", "loss_fn.beta=0.5"],
         r"unknown key 'loss_fn\.beta' \(beta belongs to loss_fn\.type = jsd, not topk\)"),
        (["loss_fn.type=topk", "loss_fn.divergence=jsd"],
         r"config key 'loss_fn\.divergence' has moved: it is now loss_fn\.type \(jsd"),
    ],
    ids=["sampled-token-lambda", "sampled-token-temperature", "sampled-token-old-temperature", "topk-beta",
         "topk-old-divergence"],
)
def test_conflicting_loss_settings_are_refused_with_the_keys_named(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        setup(run_config(tmp_path, *overrides))  # refused at load, before setup
    assert not (tmp_path / "run" / "logs").exists(), "nothing may start before the config is rejected"


def test_task_reward_without_ground_truth_is_refused(tmp_path):
    data = tmp_path / "no_answers.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}]}
            for i in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = run_config(tmp_path, "loss_fn.type=sampled_token", "loss_fn.adv_tau=0.5", f"data.train_path={data}")
    with pytest.raises(ConfigError, match=r"loss_fn\.adv_tau = 0\.5.*4 of 4 examples.*no ground-truth"):
        setup(config)


@pytest.mark.parametrize(("loss_type", "key"), [
    ("jsd", "loss_fn.beta=1.5"), ("full_vocab", "loss_fn.metrics_topk=0"), ("jsd", "loss_fn.metrics_topk=0"),
    ("topk", "loss_fn.k=0"), (None, "loss_fn.type=exact"), ("sampled_token", "loss_fn.discount=-0.1"),
    ("full_vocab", "loss_fn.chunk_size=0"), ("sampled_token", "loss_fn.clip_ratio=0"),
])
def test_out_of_range_loss_keys_are_rejected_at_load(tmp_path, loss_type, key):
    overrides = ([f"loss_fn.type={loss_type}"] if loss_type else []) + [key]
    with pytest.raises(ConfigError, match=key.split("=")[0].replace(".", r"\.")) as error:
        run_config(tmp_path, *overrides)
    assert "unknown key" not in str(error.value)  # refused for its value, not as a key of another type


def test_the_loss_config_builds_a_loss_with_every_key(tmp_path):
    config = run_config(tmp_path, "loss_fn.type=topk", "loss_fn.k=7", "loss_fn.tail=false",
                        "loss_fn.fused_lm_head=false", "loss_fn.chunk_size=33", "loss_fn.kl_type=mixed",
                        "loss_fn.mixed_kl_weight=0.25", "loss_fn.temperature=1.5",
                        "loss_fn.reduction=sum")
    loss_fn = config.loss_fn.build(100, "cpu")
    assert type(loss_fn) is TopKKLLossFn and isinstance(loss_fn, DistillationLossFn)
    assert (loss_fn.k, loss_fn.metrics_topk, loss_fn.tail, loss_fn.fused_lm_head) == (7, 7, False, False)
    assert (loss_fn.kl_type, loss_fn.mixed_kl_weight, loss_fn.temperature, loss_fn.kl_reduction) == ("mixed", 0.25, 1.5, "sum")
    assert (loss_fn.chunk_size, loss_fn.vocab_size) == (33, 100)

    config = run_config(tmp_path, "loss_fn.type=sampled_token", "loss_fn.teacher_tau=0.5", "loss_fn.student_tau=2.0",
                        "loss_fn.discount=0.9", "loss_fn.adv_tau=3.0", "loss_fn.clip_ratio=null")
    loss_fn = config.loss_fn.build(100, "cpu")
    assert isinstance(loss_fn, SampledTokenLossFn)
    assert (loss_fn.teacher_tau, loss_fn.student_tau, loss_fn.discount, loss_fn.adv_tau, loss_fn.clip_ratio) == (
        0.5, 2.0, 0.9, 3.0, None)

    config = run_config(tmp_path, "loss_fn.type=jsd", "loss_fn.beta=0.3", "loss_fn.temperature=2.0",
                        "loss_fn.metrics_topk=5", "loss_fn.reduction=sum", "loss_fn.compile_kernels=false",
                        "loss_fn.chunk_size=9")
    loss_fn = config.loss_fn.build(100, "cpu")
    assert type(loss_fn) is JSDLossFn
    assert (loss_fn.beta, loss_fn.temperature, loss_fn.metrics_topk) == (0.3, 2.0, 5)
    assert (loss_fn.kl_reduction, loss_fn.compile_kernels, loss_fn.chunk_size, loss_fn.vocab_size) == (
        "sum", False, 9, 100)

    config = run_config(tmp_path, "loss_fn.type=full_vocab", "loss_fn.kl_type=forward", "loss_fn.metrics_topk=3")
    loss_fn = config.loss_fn.build(100, "cpu")
    assert type(loss_fn) is KLLossFn
    assert (loss_fn.kl_type, loss_fn.metrics_topk) == ("forward", 3)

    config = run_config(tmp_path, "loss_fn.type=hybrid_full_vocab", "loss_fn.teacher_tau=0.5",
                        "loss_fn.student_tau=2.0", "loss_fn.adv_tau=3.0", "loss_fn.reduction=sum")
    loss_fn = config.loss_fn.build(100, "cpu")
    assert isinstance(loss_fn, FullVocabHybridLossFn)
    assert (loss_fn.teacher_tau, loss_fn.student_tau, loss_fn.adv_tau, loss_fn.kl_reduction, loss_fn.vocab_size) == (
        0.5, 2.0, 3.0, "sum", 100)


# --------------------------------------------------------------------------- metrics and values


def masked_case(seed: int, vocab: int = 9):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(3, 6, vocab, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(3, 6, vocab, generator=generator, dtype=torch.float64) * 2
    token_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    input_ids = torch.randint(0, vocab, (3, 6), generator=generator)
    return student, teacher, {"token_mask": token_mask, "input_ids": input_ids}


@pytest.mark.parametrize("k", [1, 3, 9, 20])
def test_top_k_metrics_against_a_reference(k):
    student, teacher, data = masked_case(0)
    loss_fn = KLLossFn("forward", metrics_topk=k)
    _, metrics = loss_fn(student, data, 100, 3, teacher_output=teacher)
    sums = {"teacher_topk_mass": 0.0, "student_mass_on_teacher_topk": 0.0, "topk_overlap": 0.0}
    for b in range(3):
        for t in range(5):
            if data["token_mask"][b, t + 1] == 0:
                continue
            p = torch.softmax(teacher[b, t], -1).tolist()
            q = torch.softmax(student[b, t], -1).tolist()
            kk = min(k, len(p))
            top_p = sorted(range(len(p)), key=lambda v: -p[v])[:kk]
            top_q = sorted(range(len(q)), key=lambda v: -q[v])[:kk]
            sums["teacher_topk_mass"] += sum(p[v] for v in top_p)
            sums["student_mass_on_teacher_topk"] += sum(q[v] for v in top_p)
            sums["topk_overlap"] += len(set(top_p) & set(top_q)) / kk
    for key, value in sums.items():
        assert metrics[key] == pytest.approx(value / 100, rel=1e-12), key
    if k >= 9:  # the top-k covers the vocabulary: all mass, full overlap
        assert metrics["teacher_topk_mass"] == pytest.approx(metrics["num_valid_tokens"] / 100)


def test_sampled_token_loss_against_a_reference():
    student, teacher, data = masked_case(1)
    generator = torch.Generator().manual_seed(2)
    data["generation_logprobs"] = -torch.rand(3, 6, generator=generator, dtype=torch.float64)
    teacher_token = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 2
    reward = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    data["task_reward"] = reward
    tau_t, tau_s, gamma, tau_r, eps = 0.7, 1.3, 0.5, 2.0, 0.2
    loss_fn = SampledTokenLossFn(tau_t, tau_s, gamma, tau_r, eps)
    loss, metrics = loss_fn(student.clone().requires_grad_(True), data, 40, 3, teacher_output=teacher_token)

    expected, kl_sum = 0.0, 0.0
    for b in range(3):
        positions = [t for t in range(5) if data["token_mask"][b, t + 1] == 1]
        per_token = {t: tau_t * float(teacher_token[b, t + 1]) - tau_s * float(data["generation_logprobs"][b, t + 1])
                     + tau_r * float(reward[b]) for t in positions}
        for t in positions:
            advantage = sum(gamma ** (u - t) * per_token[u] for u in positions if u >= t)
            token = int(data["input_ids"][b, t + 1])
            log_q = float(torch.log_softmax(student[b, t], -1)[token])
            ratio = math.exp(log_q - float(data["generation_logprobs"][b, t + 1]))
            expected += -min(ratio * advantage, min(max(ratio, 1 - eps), 1 + eps) * advantage)
            kl_sum += float(data["generation_logprobs"][b, t + 1]) - float(teacher_token[b, t + 1])
    assert float(loss.detach()) == pytest.approx(expected / 40, rel=1e-12)
    assert metrics["kl_reverse_estimate"] == pytest.approx(kl_sum / 40, rel=1e-12)
    assert metrics["num_valid_tokens"] == 8


# --------------------------------------------------------------------------- real runs


def test_fused_and_plain_runs_log_the_same_losses(tmp_path):
    runs = {}
    for fused in ("true", "false"):
        config = run_config(tmp_path / fused, f"loss_fn.fused_lm_head={fused}", "loss_fn.kl_type=mixed")
        distillation_train(setup(config))
        runs[fused] = train_records(config)
    assert len(runs["true"]) == len(runs["false"]) == 3
    for fused, plain in zip(runs["true"], runs["false"]):
        for key in ("train/loss", "train/kl_forward", "train/kl_reverse", "train/teacher_topk_mass",
                    "train/student_mass_on_teacher_topk", "train/topk_overlap", "train/grad_norm"):
            assert fused[key] == pytest.approx(plain[key], rel=2e-4, abs=1e-6), key


@pytest.mark.parametrize(
    ("overrides", "expected_keys"),
    [
        (["loss_fn.type=topk", "loss_fn.k=4"], ["train/kl_forward", "train/teacher_topk_mass"]),
        (["loss_fn.type=topk", "loss_fn.k=4", "loss_fn.tail=false"], ["train/topk_overlap"]),
        (["loss_fn.type=jsd", "loss_fn.beta=0.3"], ["train/kl_reverse"]),
        (["loss_fn.type=sampled_token", "loss_fn.adv_tau=1.0", "loss_fn.discount=0.5",
          "distillation.generate_strategy.decoding_method=top_p", "distillation.generate_strategy.temperature=1.0",
          "distillation.generate_strategy.top_p=1.0"], ["train/kl_reverse_estimate", "train/task_reward"]),
    ],
    ids=["topk-tail", "topk-renorm", "jsd", "sampled-token"],
)
def test_each_teacher_signal_trains(tmp_path, overrides, expected_keys):
    config = run_config(tmp_path, "training.learning_rate=1e-3", *overrides)
    parts = setup(config)
    before = {name: p.detach().clone() for name, p in parts.student_policy.model.named_parameters()}
    distillation_train(parts)
    records = train_records(config)
    assert len(records) == 3
    for record in records:
        assert math.isfinite(record["train/loss"]) and record["train/skipped_nonfinite"] == 0
        for key in expected_keys:
            assert math.isfinite(record[key]), key
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in parts.student_policy.model.named_parameters())
    assert moved > 1e-5, "the student must actually be updated"
