"""The rollout schedules (``training.scheduler``) in one process, with real tiny models.

* Which weights sample each batch: every trained batch is re-generated (greedy) from the
  weights the schedule claims it was sampled with, and must come out token for token;
  under ``one_step_off`` batch t + 1 comes from the weights before update t, under
  ``two_step_off`` batch t + 2. The test also shows that the neighbouring version would
  have generated something else, so it can fail.
* The logged versions and staleness, and the importance-ratio metrics (exactly 1 on fresh
  batches).
* A run that crashes after a checkpoint and is rerun trains the same prompts with the same
  losses and ends with bitwise the same weights as the uninterrupted run, across epoch
  boundaries, with sampling (the RNG streams) and with batches in flight at the checkpoint.
* Config errors for schedules that cannot run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from opd_test_helpers import short_run_overrides

from opd.distillation.config import DEPTHS, MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import RolloutSchedule, distillation_train
from opd.models.tiny import build_tiny_model
from opd.rollout.hf_generation import HFGeneration, SnapshotHFGeneration
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TINY_TRAIN = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"


def small_data(tmp_path: Path, rows: int = 5) -> Path:
    """The first ``rows`` tiny training rows: with batch size 2, an epoch ends every 2 steps."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(TINY_TRAIN.read_text().splitlines(keepends=True)[:rows]))
    return path


def run_config(tmp_path: Path, scheduler: str, *overrides: str, run_name: str = "run") -> MasterConfig:
    base = [
        *short_run_overrides(tmp_path, run_name),
        f"data.train_path={small_data(tmp_path)}",
        f"training.scheduler={scheduler}",
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=5",
        "training.learning_rate=0.05",  # large: consecutive versions must sample differently
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=8",
    ]
    return load_config(MasterConfig, TINY_CONFIG, base + list(overrides))


def records(config: MasterConfig) -> list[dict]:
    path = Path(config.logger.log_dir) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if "train/loss" in line]


def record_training(parts) -> list[tuple[dict[str, torch.Tensor], dict]]:
    """Wraps the student's ``train``: each call records the weights it starts from and its batch."""
    calls: list[tuple[dict[str, torch.Tensor], dict]] = []
    policy = parts.student_policy
    original = policy.train

    def recording_train(batch, loss_fn, teacher_signal=None, timer=None):
        weights = {name: tensor.detach().clone() for name, tensor in policy.model.state_dict().items()}
        calls.append((weights, {key: value for key, value in batch.items()}))
        return original(batch, loss_fn, teacher_signal, timer)

    policy.train = recording_train  # type: ignore[method-assign]
    return calls


def responses(batch: dict) -> list[list[int]]:
    return [
        batch["input_ids"][row, : int(batch["input_lengths"][row])].tolist()
        for row in range(batch["input_ids"].shape[0])
    ]


def regenerate(weights: dict[str, torch.Tensor], batch: dict, tokenizer, config: MasterConfig) -> list[list[int]]:
    """Greedy responses to the batch's prompts from ``weights``."""
    model = build_tiny_model("student")
    model.load_state_dict(weights)
    prompts = [
        batch["input_ids"][row, : int(batch["prompt_lengths"][row])].tolist()
        for row in range(batch["input_ids"].shape[0])
    ]
    engine = HFGeneration(model, tokenizer, config.generation.decode_loop)
    engine.prepare_for_generation()
    return responses(engine.generate(prompts, config.distillation.generate_strategy, 1, return_logprobs=False))


@pytest.mark.parametrize("scheduler", ["sync", "one_step_off", "two_step_off"])
def test_each_batch_is_sampled_with_the_weights_the_schedule_states(tmp_path, scheduler):
    loss = ["loss_fn.type=topk", "loss_fn.k=4"] if scheduler == "two_step_off" else []
    config = run_config(tmp_path, scheduler, *loss)
    parts = setup(config)
    depth = DEPTHS[scheduler]
    assert isinstance(parts.student_generation, SnapshotHFGeneration if depth else HFGeneration)
    calls = record_training(parts)
    distillation_train(parts)

    steps = records(config)
    assert len(calls) == len(steps) == 5
    weights_at = [weights for weights, _ in calls]  # weights_at[v]: version v (v updates taken)
    different_neighbour = 0
    for step, ((_, batch), record) in enumerate(zip(calls, steps, strict=True), start=1):
        version = max(step - 1 - depth, 0)  # one_step_off: batch t + 1 from the weights before update t
        assert record["train/sampled_version"] == version
        trained = responses(batch)
        assert regenerate(weights_at[version], batch, parts.tokenizer, config) == trained, f"step {step}"
        if depth:
            assert record["train/staleness_mean"] == record["train/staleness_max"] == step - 1 - version
            assert "timing/wait_prev_gen" in record and "timing/generation" not in record
        else:
            assert "train/staleness_mean" not in record and "timing/generation" in record
        # The neighbouring version would have sampled something else (the check has teeth).
        neighbour = version + 1 if version + 1 < step else None
        if neighbour is not None and regenerate(weights_at[neighbour], batch, parts.tokenizer, config) != trained:
            different_neighbour += 1
    if depth:
        assert different_neighbour >= 2, "the learning rate is too small for versions to sample differently"


def test_importance_ratio_metrics(tmp_path):
    config = run_config(tmp_path, "one_step_off", "training.off_policy_correction.enabled=true")
    parts = setup(config)
    assert parts.loss_fn.off_policy is not None
    distillation_train(parts)
    steps = records(config)
    assert steps[0]["train/staleness_mean"] == 0 and steps[0]["train/is_ratio_mean"] == 1.0
    assert steps[0]["train/is_ratio_max"] == 1.0
    stale = steps[1:]
    assert all(step["train/staleness_mean"] == 1 for step in stale)
    assert any(step["train/is_ratio_mean"] != 1.0 for step in stale)
    assert all(step["train/is_ratio_max"] >= step["train/is_ratio_mean"] > 0 for step in stale)


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.off_policy_correction.enabled=false"],
        [],  # auto: off for the full-vocabulary loss (the correction study, guide §11)
    ],
    ids=["off", "auto"],
)
def test_correction_off_leaves_stale_samples_unweighted(tmp_path, overrides):
    config = run_config(tmp_path, "one_step_off", *overrides)
    parts = setup(config)
    assert parts.loss_fn.off_policy is None
    distillation_train(parts)
    assert not any("train/is_ratio_mean" in step for step in records(config))


class Crash(RuntimeError):
    """Stands for the process dying in the middle of a step."""


MIXTURE_PAIR = [
    "model.teacher_model_path=null", "teachers.mode=mixture",
    "teachers.members=[{name: a, model_path: 'tiny:teacher'}, {name: b, model_path: 'tiny:student-b'}]",
]


@pytest.mark.parametrize(
    ("scheduler", "teachers"),
    [("one_step_off", []), ("two_step_off", []), ("two_step_off", MIXTURE_PAIR)],
    ids=["one_step_off", "two_step_off", "two_step_off_mixture"],  # a mixture's answers are in flight
)
def test_crash_and_rerun_trains_exactly_what_the_uninterrupted_run_trains(tmp_path, scheduler, teachers):
    common = [
        *teachers,
        "checkpointing.enabled=true",
        "checkpointing.keep_top_k=null",
        "training.save_freq=3",
        "training.max_num_steps=7",
        "distillation.generate_strategy.decoding_method=top_p",  # sampling: the RNG streams matter
        "distillation.generate_strategy.temperature=1.0",
        "loss_fn.type=topk",
        "loss_fn.k=4",
    ]
    reference_config = run_config(tmp_path, scheduler, *common, run_name="reference")
    reference = setup(reference_config)
    reference_calls = record_training(reference)
    distillation_train(reference)

    config = run_config(tmp_path, scheduler, *common, run_name="crashed")
    first = setup(config)
    first_calls = record_training(first)
    original = first.student_policy.train

    def crash_at_step_5(batch, loss_fn, teacher_signal=None, timer=None):
        if len(first_calls) == 5:
            raise Crash("killed during step 5")
        return original(batch, loss_fn, teacher_signal, timer)

    first.student_policy.train = crash_at_step_5  # type: ignore[method-assign]
    with pytest.raises(Crash):
        distillation_train(first)
    first.close()

    resumed = setup(config)  # finds step_3, with the batches it had in flight
    assert resumed.distillation_save_state["step"] == 3
    resumed_calls = record_training(resumed)
    distillation_train(resumed)

    trained = [batch for _, batch in first_calls[:3]] + [batch for _, batch in resumed_calls]
    assert len(trained) == len(reference_calls) == 7
    for step, (batch, (_, expected)) in enumerate(zip(trained, reference_calls, strict=True), start=1):
        assert responses(batch) == responses(expected), f"step {step} trained other samples"
    losses = [step["train/loss"] for step in records(config)]
    assert losses == [step["train/loss"] for step in records(reference_config)]
    final = resumed.student_policy.model.state_dict()
    for name, tensor in reference.student_policy.model.state_dict().items():
        assert torch.equal(final[name], tensor), name


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["training.scheduler=one_step_off", "cluster.placement=colocated"], r"cluster\.placement = split"),
        (
            ["training.scheduler=two_step_off", "loss_fn.type=topk", "cluster.placement=split"],
            r"cluster\.teacher\.placement = pool",
        ),
        (["training.off_policy_correction.token_bounds=[2.0, 3.0]"], r"token_bounds"),
        (["training.scheduler=three_step_off"], r"training\.scheduler"),
    ],
)
def test_schedules_that_cannot_run_are_config_errors(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(MasterConfig, TINY_CONFIG, [*short_run_overrides(tmp_path), *overrides])


def test_a_checkpoint_in_flight_resumes_only_under_its_scheduler(tmp_path):
    config = run_config(tmp_path, "sync")
    parts = setup(config)
    schedule = RolloutSchedule(
        "sync",
        parts.student_generation,
        parts.teacher_policy,
        parts.student_policy,
        parts.loss_fn,
        parts.tokenizer,
        config,
        random.Random(0),
    )
    schedule.load_state_dict({"depth": 1, "slots": []})  # nothing in flight: any scheduler may resume
    saved = {
        "depth": 1,
        "slots": [
            {
                "examples": [],
                "on_policy": False,
                "sampled_version": None,
                "batch": None,
                "teacher_signal": None,
                "teacher_started": False,
            }
        ],
    }
    with pytest.raises(ConfigError, match=r"training\.scheduler = one_step_off"):
        schedule.load_state_dict(saved)


def test_what_each_weight_sync_moved_is_logged_with_its_step(tmp_path):
    """``refit/bytes`` and ``refit/bytes_delivered``, as the engine's refit reports them, reach that step's record.

    Under one-step-off every step syncs once (the first before its warm-up rollout), so
    step k logs the k-th refit's figures; validation syncs are not steps' syncs.
    """
    config = run_config(tmp_path, "one_step_off")
    parts = setup(config)
    engine = parts.student_generation
    original = engine.refit
    reported: list[float] = []

    def reporting_refit(policy):
        original(policy)
        reported.append(1000.0 * (len(reported) + 1))
        return {"refit/bytes": reported[-1], "refit/bytes_delivered": 2 * reported[-1]}

    engine.refit = reporting_refit  # type: ignore[method-assign]
    distillation_train(parts)
    steps = records(config)
    assert len(steps) == 5 and len(reported) == 5
    assert [record["refit/bytes"] for record in steps] == reported
    assert [record["refit/bytes_delivered"] for record in steps] == [2 * value for value in reported]
