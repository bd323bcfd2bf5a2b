"""Run lifecycle of ``opd train``: kill and resume, graceful stop, non-finite steps,
checkpoint safety and retention, ``opd eval`` and the teacher baseline.

All runs use the tiny CPU demo config cut down to 12 fast steps (λ = 0.5, so both the
on-policy and the fixed-data branch run and the λ coin matters; 40 prompts in batches of 8,
so an epoch is 5 steps and two epoch boundaries are crossed; a checkpoint every 3 steps).

An uninterrupted run is the reference. Every interrupted run must, after rerunning the
very same command, log the same per-step losses and on/off-policy decisions and end with
bitwise the same final weights. The interruptions are made deterministic by
``lifecycle_runner.py`` (next to this file), which runs ``opd.cli.main`` with hooks that
pause a run after a given step or inside a checkpoint write, so the test can SIGKILL or
signal it at an exact point instead of racing a 0.05 s step.

Each ``opd`` process pays a few seconds for importing torch and transformers, so the
subprocess scenarios are started together once per module (``lifecycle``) and checked by
the tests one by one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from opd_test_helpers import BackgroundProcess
from safetensors.torch import load_file

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.interfaces import LossFunction
from opd.run.checkpoint import CheckpointingConfig, CheckpointManager
from opd.utils.config import load_config, validate_config
from opd.utils.errors import TrainingDivergedError

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().with_name("lifecycle_runner.py")
TINY = "examples/configs/distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
VAL_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "val.jsonl"

TOTAL_STEPS = 12
SAVE_FREQ = 3
STEPS_PER_EPOCH = 5  # 40 prompts // batch_size 8
PROCESS_TIMEOUT = 180.0
# Several runs share two cores: one intra-op thread each avoids OpenMP oversubscription,
# which slows a 0.05 s step down to seconds. All runs use it, so they stay comparable.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# The resume scenarios: everything the reference and the interrupted runs share.
LIFECYCLE_OVERRIDES = [
    f"data.train_path={TRAIN_DATA}",
    f"data.val_path={VAL_DATA}",
    "data.max_train_examples=40",
    "training.batch_size=8",
    "training.num_epochs=5",
    f"training.max_num_steps={TOTAL_STEPS}",
    f"training.save_freq={SAVE_FREQ}",
    "training.val_freq=0",
    "validation.val_at_start=false",
    "validation.val_at_end=false",
    "distillation.lambda=0.5",
    "distillation.generate_strategy.max_length=8",
    "validation.generate_strategy.max_length=8",
]


# --------------------------------------------------------------------------- helpers


def train_argv(output_dir: Path, *extra: str) -> list[str]:
    """``opd`` arguments of one lifecycle run (without the program)."""
    return ["train", "--config", str(REPO_ROOT / TINY), f"output_dir={output_dir}", *LIFECYCLE_OVERRIDES, *extra]


class Process(BackgroundProcess):
    """An ``opd`` process, started plainly or through ``lifecycle_runner.py`` with pause hooks."""

    def __init__(self, name: str, argv: list[str], workdir: Path, hooks: dict | None = None) -> None:
        self.argv = argv
        if hooks is None:
            command = [sys.executable, "-m", "opd", *argv]
        else:
            command = [sys.executable, str(RUNNER), json.dumps(hooks), *argv]
        super().__init__(name, command, workdir, SUBPROCESS_ENV, PROCESS_TIMEOUT)


def read_records(output_dir: Path) -> list[dict]:
    """The whole records of ``metrics.jsonl`` (a run still writing may have left its last line half written)."""
    path = output_dir / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    whole = path.read_text().rpartition("\n")[0]  # up to the last newline: a line without one is still being written
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def train_records(output_dir: Path) -> list[dict]:
    """The training-step records of ``metrics.jsonl``, in file order."""
    return [record for record in read_records(output_dir) if "train/loss" in record]


def last_train_step(output_dir: Path) -> int:
    records = train_records(output_dir)
    return records[-1]["step"] if records else 0


def checkpoint_manager(output_dir: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(output_dir / "checkpoints")))


def checkpoint_steps(output_dir: Path) -> list[int]:
    return [step for step, _ in checkpoint_manager(output_dir).list_checkpoints()]


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


def assert_bitwise_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    differing = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differing, (
        f"{what}: {len(differing)} of {len(expected)} tensors differ from the reference "
        f"(max abs diff {max_abs_diff(actual, expected):.3e}; first: {differing[0]})"
    )


def assert_matches_reference(run_dir: Path, reference_dir: Path) -> None:
    """Per-step loss and λ-coin decisions, each step logged once, and the final weights."""
    records = train_records(run_dir)
    reference = train_records(reference_dir)
    steps = [record["step"] for record in records]
    assert steps == list(range(1, TOTAL_STEPS + 1)), f"training steps in metrics.jsonl: {steps}"
    assert [r["train/on_policy"] for r in records] == [r["train/on_policy"] for r in reference]
    losses = [r["train/loss"] for r in records]
    reference_losses = [r["train/loss"] for r in reference]
    worst = max(abs(a - b) for a, b in zip(losses, reference_losses))
    assert losses == reference_losses, f"per-step train/loss differs from the reference (max abs diff {worst:.3e})"
    checkpoint_records = [r["step"] for r in read_records(run_dir) if "timing/checkpoint" in r]
    assert len(checkpoint_records) == len(set(checkpoint_records)), f"checkpoint records: {checkpoint_records}"
    times = [r["time"] for r in read_records(run_dir)]
    assert times == sorted(times), f"the JSONL time must keep growing across a resume: {times}"
    assert_bitwise_equal(
        weights(run_dir / "final_model"), weights(reference_dir / "final_model"), "final_model/model.safetensors"
    )


def assert_resumed_from(rerun: Process, checkpoint: Path, step: int) -> None:
    """The rerun said where it resumed, and found the same config there (the same command)."""
    stderr = rerun.stderr
    assert f"resuming from {checkpoint} (step {step} of {TOTAL_STEPS})" in stderr, rerun.output()
    assert "resuming with a config that differs" not in stderr, rerun.output()
    assert "stopped by" not in rerun.stdout, rerun.output()


# --------------------------------------------------------------------------- subprocess scenarios


@dataclass
class Scenario:
    """One interrupted run: the first process, what was on disk after it, and the rerun."""

    output_dir: Path
    first: Process
    first_status: int | None = None
    after_first: dict = field(default_factory=dict)
    rerun: Process | None = None
    rerun_status: int | None = None


def _snapshot(output_dir: Path) -> dict:
    """What a rerun will find: files under checkpoints/, the newest checkpoint, the log."""
    root = output_dir / "checkpoints"
    latest = checkpoint_manager(output_dir).latest_checkpoint()
    return {
        "entries": sorted(child.name for child in root.iterdir()) if root.is_dir() else [],
        "tmp_complete": sorted(
            child.name for child in root.glob(".tmp_step_*") if (child / "save_state.json").is_file()
        )
        if root.is_dir()
        else [],
        "latest": latest,
        "latest_save_state": json.loads((latest / "save_state.json").read_text()) if latest else None,
        "steps": checkpoint_steps(output_dir),
        "last_train_step": last_train_step(output_dir),
        "final_model": (output_dir / "final_model").exists(),
    }


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """Runs the reference and every interrupted run in parallel, then all reruns in parallel.

    Returns ``{"reference": reference output dir, scenario name: Scenario, ...}``.
    """
    root = tmp_path_factory.mktemp("lifecycle")
    logs = root / "process_output"
    started: list[Process] = []

    def start(name, argv, hooks=None):
        process = Process(name, argv, logs, hooks)
        started.append(process)
        return process

    def pause_hooks(step, release):
        return {"pause_after_step": step, "release_file": str(release), "pause_seconds": 120}

    try:
        reference_dir = root / "reference"
        reference = start("reference", train_argv(reference_dir))
        hooks = {
            # Paused after step 7 (not a checkpoint step) and killed there.
            "sigkill": pause_hooks(7, root / "never-released"),
            # The second checkpoint (step 6) sleeps after writing all its files, before the rename.
            "sigkill_checkpoint": {"slow_checkpoint": 2, "slow_seconds": 120},
            # SIGTERM after step 5: the end of the first epoch, not a checkpoint step.
            "sigterm": pause_hooks(5, root / "release-sigterm"),
            # SIGINT after step 6, a checkpoint step: the stop must not write step_6 twice.
            "sigint": pause_hooks(6, root / "release-sigint"),
            # Killed after the last checkpoint, while final_model/ is about to be written.
            "sigkill_final": {"slow_final_model_seconds": 120},
        }
        scenarios = {
            name: Scenario(root / name, start(name, train_argv(root / name), scenario_hooks))
            for name, scenario_hooks in hooks.items()
        }

        kill = scenarios["sigkill"]
        kill.first.wait_until(lambda: last_train_step(kill.output_dir) >= 7, "training record of step 7")
        kill.first.send(signal.SIGKILL)

        mid_write = scenarios["sigkill_checkpoint"]
        tmp_dir = mid_write.output_dir / "checkpoints" / ".tmp_step_6"
        mid_write.first.wait_until((tmp_dir / "save_state.json").is_file, "a complete .tmp_step_6")
        mid_write.first.send(signal.SIGKILL)

        for name, sig in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
            scenario, step = scenarios[name], hooks[name]["pause_after_step"]
            scenario.first.wait_until(lambda: last_train_step(scenario.output_dir) >= step, f"record of step {step}")
            scenario.first.send(sig)
            Path(hooks[name]["release_file"]).touch()

        final = scenarios["sigkill_final"]
        final.first.wait_until(
            lambda: any("timing/checkpoint" in r and r["step"] == TOTAL_STEPS for r in read_records(final.output_dir)),
            f"the timing record of checkpoint step_{TOTAL_STEPS}",
        )
        final.first.send(signal.SIGKILL)

        for scenario in scenarios.values():
            scenario.first_status = scenario.first.wait()
            scenario.after_first = _snapshot(scenario.output_dir)
        # Rerun exactly the same command, now without hooks: `python -m opd train ...`.
        for name, scenario in scenarios.items():
            scenario.rerun = start(f"{name}_rerun", scenario.first.argv)
        for scenario in scenarios.values():
            scenario.rerun_status = scenario.rerun.wait()

        assert reference.wait() == 0, reference.output()
        yield {"reference": reference_dir, **scenarios}
    finally:
        for process in started:
            process.stop_if_running()


def test_sigkill_mid_run_then_rerun_matches_uninterrupted_run(lifecycle):
    scenario: Scenario = lifecycle["sigkill"]
    reference = lifecycle["reference"]
    assert scenario.first_status == -signal.SIGKILL, scenario.first.output()
    state = scenario.after_first
    assert state["last_train_step"] == 7
    assert state["steps"] == [3, 6]
    assert not state["final_model"]

    assert scenario.rerun_status == 0, scenario.rerun.output()
    assert_resumed_from(scenario.rerun, scenario.output_dir / "checkpoints" / "step_6", 6)
    # Sanity of the reference itself: both branches ran and an epoch boundary was crossed.
    reference_records = train_records(reference)
    assert {r["train/on_policy"] for r in reference_records} == {0, 1}
    assert [r["train/epoch"] for r in reference_records] == [step // STEPS_PER_EPOCH for step in range(TOTAL_STEPS)]
    assert_matches_reference(scenario.output_dir, reference)


def test_sigkill_during_checkpoint_write_resumes_from_previous_checkpoint(lifecycle):
    scenario: Scenario = lifecycle["sigkill_checkpoint"]
    assert scenario.first_status == -signal.SIGKILL, scenario.first.output()
    state = scenario.after_first
    # The killed write left a temporary directory with every file in it, save_state.json included...
    assert ".tmp_step_6" in state["entries"] and state["tmp_complete"] == [".tmp_step_6"], state
    assert "step_6" not in state["entries"], state
    # ...which is never taken for a checkpoint.
    assert state["latest"] == scenario.output_dir / "checkpoints" / "step_3"
    assert state["steps"] == [3]
    assert state["last_train_step"] == 6

    assert scenario.rerun_status == 0, scenario.rerun.output()
    stderr = scenario.rerun.stderr
    assert "incomplete checkpoint" in stderr and ".tmp_step_6" in stderr, stderr
    assert_resumed_from(scenario.rerun, scenario.output_dir / "checkpoints" / "step_3", 3)
    leftovers = sorted(path.name for path in (scenario.output_dir / "checkpoints").glob(".tmp_*"))
    assert leftovers == []
    assert checkpoint_steps(scenario.output_dir) == [6, 9, 12]
    assert_matches_reference(scenario.output_dir, lifecycle["reference"])


@pytest.mark.parametrize(("name", "signal_name", "step"), [("sigterm", "SIGTERM", 5), ("sigint", "SIGINT", 6)])
def test_graceful_stop_checkpoints_and_rerun_matches(lifecycle, name, signal_name, step):
    scenario: Scenario = lifecycle[name]
    assert scenario.first_status == 0, scenario.first.output()
    stopped = [line for line in scenario.first.stdout.splitlines() if f"stopped by {signal_name}" in line]
    assert len(stopped) == 1, scenario.first.output()
    assert "rerun the same command to resume" in stopped[0]
    state = scenario.after_first
    stop_step = state["last_train_step"]
    assert stop_step >= step
    assert f"after step {stop_step}/{TOTAL_STEPS}" in stopped[0]
    stop_checkpoint = scenario.output_dir / "checkpoints" / f"step_{stop_step}"
    assert state["latest"] == stop_checkpoint
    assert str(stop_checkpoint) in stopped[0]
    assert state["latest_save_state"]["step"] == stop_step
    assert not state["final_model"]
    first_run_checkpoints = [r["step"] for r in read_records(scenario.output_dir) if "timing/checkpoint" in r]
    assert first_run_checkpoints.count(stop_step) == 1

    assert scenario.rerun_status == 0, scenario.rerun.output()
    assert_resumed_from(scenario.rerun, stop_checkpoint, stop_step)
    assert_matches_reference(scenario.output_dir, lifecycle["reference"])


def test_sigkill_before_final_model_leaves_last_checkpoint(lifecycle):
    scenario: Scenario = lifecycle["sigkill_final"]
    assert scenario.first_status == -signal.SIGKILL, scenario.first.output()
    state = scenario.after_first
    assert state["latest"] == scenario.output_dir / "checkpoints" / f"step_{TOTAL_STEPS}"
    assert not state["final_model"]
    assert scenario.rerun_status == 0, scenario.rerun.output()


def test_sigkill_before_final_model_rerun_writes_final_model(lifecycle):
    scenario: Scenario = lifecycle["sigkill_final"]
    final_model = scenario.output_dir / "final_model"
    assert (final_model / "model.safetensors").is_file(), scenario.rerun.output()
    assert_bitwise_equal(weights(final_model), weights(lifecycle["reference"] / "final_model"), "final_model")


def test_checkpoint_files_are_safe_and_complete(lifecycle):
    reference = lifecycle["reference"]
    steps = checkpoint_steps(reference)
    assert steps == [6, 9, 12]  # keep_top_k = 3, no best metric (no validation)
    expected_config = load_config(MasterConfig, REPO_ROOT / TINY, [f"output_dir={reference}", *LIFECYCLE_OVERRIDES])
    for step in steps:
        checkpoint = reference / "checkpoints" / f"step_{step}"
        for pt_file in sorted(checkpoint.rglob("*.pt")):
            torch.load(pt_file, weights_only=True)  # raises on anything but tensors and containers
        assert {p.name for p in checkpoint.glob("*.pt")} == {"optimizer.pt", "training_state.pt"}
        training_state = torch.load(checkpoint / "training_state.pt", weights_only=True)
        assert {"dataloader", "rng"} <= training_state.keys()
        assert {"python", "numpy", "torch", "lambda_coin"} <= training_state["rng"].keys()
        optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        assert {"optimizer", "scheduler"} <= optimizer_state.keys()

        policy = checkpoint / "policy"
        for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json"):
            assert (policy / name).is_file(), f"{policy} lacks {name}"
        save_state = json.loads((checkpoint / "save_state.json").read_text())
        assert {"step", "epoch", "consumed_samples", "best_metric", "best_step"} <= save_state.keys()
        assert save_state["step"] == step
        assert save_state["epoch"] == (step - 1) // STEPS_PER_EPOCH
        assert save_state["consumed_samples"] == step * 8
        saved_config = validate_config(MasterConfig, yaml.safe_load((checkpoint / "config.yaml").read_text()))
        assert saved_config == expected_config

    from transformers import AutoModelForCausalLM, AutoTokenizer

    last = reference / "checkpoints" / f"step_{TOTAL_STEPS}" / "policy"
    model = AutoModelForCausalLM.from_pretrained(str(last))
    AutoTokenizer.from_pretrained(str(last))
    loaded = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    final = weights(reference / "final_model")
    for name, tensor in final.items():
        assert torch.equal(loaded[name], tensor), name
    # The last checkpoint holds exactly the final model.
    assert_bitwise_equal(weights(last), final, "step_12/policy vs final_model")


# --------------------------------------------------------------------------- in-process runs


def inprocess_config(output_dir: Path, *overrides: str) -> MasterConfig:
    """A short in-process run: 4 steps, no validation, no checkpoints, quiet console."""
    base = [
        f"output_dir={output_dir}",
        f"data.train_path={TRAIN_DATA}",
        f"data.val_path={VAL_DATA}",
        "data.max_train_examples=40",
        "training.batch_size=8",
        "training.max_num_steps=4",
        "training.val_freq=0",
        "training.save_freq=0",
        "training.warmup_steps=0",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.console=false",
        "distillation.generate_strategy.max_length=8",
        "validation.generate_strategy.max_length=8",
    ]
    return load_config(MasterConfig, REPO_ROOT / TINY, base + list(overrides))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


class NaNOnSomeSteps(LossFunction):
    """``loss``, except that ``poisoned()`` steps multiply its value by NaN; asks the teacher what ``loss`` asks."""

    def __init__(self, loss: LossFunction, poisoned) -> None:
        self.loss = loss
        self.poisoned = poisoned
        self.fused_lm_head = loss.fused_lm_head

    @property
    def teacher_request(self):
        return self.loss.teacher_request

    @property
    def needs_task_reward(self) -> bool:
        return self.loss.needs_task_reward

    @property
    def needs_sampler_logprobs(self) -> bool:
        return self.loss.needs_sampler_logprobs

    def loss_and_metrics(self, *args, **kwargs):
        value, metrics = self.loss.loss_and_metrics(*args, **kwargs)
        if self.poisoned():
            value = value * float("nan")
        return value, metrics


def run_with_nan_steps(config: MasterConfig, nan_steps) -> dict:
    """Runs ``distillation_train`` with a loss that is NaN on ``nan_steps`` (a set or "all").

    Returns the student's weights before training and after every optimizer step, the
    optimizer's and scheduler's step counters after every step, and the raised error.
    """
    parts = setup(config)
    policy = parts.student_policy
    trace = {"initial": snapshot(policy.model), "after": [], "optimizer_steps": [], "scheduler_steps": [],
             "error": None}
    step = {"n": 0}
    original_train = policy.train

    def spy_train(batch, loss, *args, **kwargs):
        step["n"] += 1
        result = original_train(batch, loss, *args, **kwargs)
        trace["after"].append(snapshot(policy.model))
        adam_steps = {int(state["step"]) for state in policy.optimizer.state.values()}
        trace["optimizer_steps"].append(adam_steps)
        trace["scheduler_steps"].append(policy.scheduler.last_epoch)
        return result

    policy.train = spy_train
    parts.loss_fn = NaNOnSomeSteps(parts.loss_fn, lambda: nan_steps == "all" or step["n"] in nan_steps)
    try:
        distillation_train(parts)
    except TrainingDivergedError as error:
        trace["error"] = error
    trace["records"] = train_records(Path(config.output_dir))
    trace["policy"] = policy
    return trace


def test_nonfinite_step_is_skipped_without_touching_weights(tmp_path):
    config = inprocess_config(tmp_path / "run")
    trace = run_with_nan_steps(config, {2})
    assert trace["error"] is None
    records = trace["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["train/skipped_nonfinite"] for r in records] == [0, 1, 0, 0]
    assert records[1]["train/grad_norm"] == "nan"  # non-finite values are kept as strings in JSONL
    after = trace["after"]
    assert_bitwise_equal(after[1], after[0], "weights after the skipped step 2 vs after step 1")
    for before, later in ((trace["initial"], after[0]), (after[1], after[2])):
        assert any(not torch.equal(before[name], later[name]) for name in before), "a finite step must update"
    # No optimizer or schedule step for the skipped one.
    assert trace["optimizer_steps"] == [{1}, {1}, {2}, {3}]
    assert trace["scheduler_steps"] == [1, 1, 2, 3]
    assert all(torch.isfinite(p).all() for p in trace["policy"].model.parameters())
    final = weights(Path(config.output_dir) / "final_model")
    assert all(torch.isfinite(tensor).all() for tensor in final.values())


def test_nonfinite_counter_resets_after_a_finite_step(tmp_path):
    config = inprocess_config(
        tmp_path / "run", "training.max_num_steps=6", "training.max_consecutive_nonfinite_steps=3"
    )
    trace = run_with_nan_steps(config, {1, 2, 4, 5})
    assert trace["error"] is None
    assert [r["train/skipped_nonfinite"] for r in trace["records"]] == [1, 1, 0, 1, 1, 0]
    assert_bitwise_equal(trace["after"][1], trace["initial"], "two skipped steps at the start")
    assert (Path(config.output_dir) / "final_model" / "model.safetensors").is_file()


def test_consecutive_nonfinite_steps_raise_training_diverged(tmp_path):
    config = inprocess_config(
        tmp_path / "run", "training.max_num_steps=8", "training.max_consecutive_nonfinite_steps=3"
    )
    trace = run_with_nan_steps(config, "all")
    assert isinstance(trace["error"], TrainingDivergedError)
    assert "3 consecutive steps" in str(trace["error"])
    assert len(trace["after"]) == 3
    assert [r["step"] for r in trace["records"]] == [1, 2, 3]
    assert all(r["train/skipped_nonfinite"] == 1 for r in trace["records"])
    assert_bitwise_equal(trace["after"][-1], trace["initial"], "weights after 3 skipped steps")
    assert not (Path(config.output_dir) / "final_model").exists()


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_keep_top_k_keeps_newest_and_best_checkpoint(tmp_path, higher_is_better):
    output_dir = tmp_path / "run"
    config = inprocess_config(
        output_dir,
        "training.max_num_steps=8",
        "training.save_freq=2",
        "training.val_freq=2",
        "validation.val_at_end=true",
        "checkpointing.enabled=true",
        "checkpointing.keep_top_k=2",
        "checkpointing.metric_name=val/kl_reverse",
        f"checkpointing.higher_is_better={str(higher_is_better).lower()}",
    )
    distillation_train(setup(config))
    validations = {r["step"]: r["val/kl_reverse"] for r in read_records(output_dir) if "val/kl_reverse" in r}
    assert sorted(validations) == [2, 4, 6, 8]
    pick = max if higher_is_better else min
    best_step = pick(validations, key=validations.get)
    newest = [6, 8]
    if higher_is_better:
        # The construction under test: a decreasing KL with "higher is better" makes an old step the best.
        assert best_step not in newest, f"the best checkpoint should be an old one: {validations}"
    assert checkpoint_steps(output_dir) == sorted(set(newest) | {best_step})
    remaining = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    assert remaining == [f"step_{step}" for step in sorted(set(newest) | {best_step})]
    save_state = json.loads((output_dir / "checkpoints" / "step_8" / "save_state.json").read_text())
    assert save_state["best_step"] == best_step
    assert save_state["best_metric"] == validations[best_step]


def test_teacher_baseline_logs_step_zero_record_without_kl(tmp_path):
    output_dir = tmp_path / "run"
    config = inprocess_config(output_dir, "training.max_num_steps=1", "validation.teacher_baseline=true")
    distillation_train(setup(config))
    step_zero = [r for r in read_records(output_dir) if r["step"] == 0]
    assert len(step_zero) == 1, step_zero
    record = step_zero[0]
    assert 0.0 <= record["val/teacher_accuracy"] <= 1.0  # the val data has ground truth
    assert record["val/teacher_mean_response_length"] > 0
    assert not [key for key in record if key.startswith("val/teacher_kl")], record
    assert not [key for key in record if key.startswith("val/kl")], record  # val_at_start is off


# --------------------------------------------------------------------------- the CLI in-process


@pytest.fixture
def cli(capsys):
    """Calls ``opd.cli.main`` in this process; returns ``(status, stdout, stderr)``.

    ``main`` routes opd's log messages to the (captured) stderr of the moment; the logger is
    put back afterwards so later tests do not write into a closed capture.
    """
    import logging

    from opd.cli import main

    opd_log = logging.getLogger("opd")
    saved = (list(opd_log.handlers), opd_log.level, opd_log.propagate)

    def run(*argv: str) -> tuple[int, str, str]:
        status = main(list(argv))
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    yield run
    opd_log.handlers[:], opd_log.level, opd_log.propagate = saved


def test_cli_diverging_run_exits_1_with_one_error_line(tmp_path, cli, monkeypatch):
    from opd.losses.distillation_losses import DistillationLossFn

    original_call = DistillationLossFn.loss_and_metrics

    def nan_call(self, *args, **kwargs):
        loss, metrics = original_call(self, *args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(DistillationLossFn, "loss_and_metrics", nan_call)
    output_dir = tmp_path / "run"
    status, out, err = cli(*train_argv(output_dir, "training.max_consecutive_nonfinite_steps=3",
                                       "logger.console=false"))
    assert status == 1, out + err
    errors = [line for line in err.splitlines() if line.startswith("opd: error:")]
    assert len(errors) == 1, err
    assert "3 consecutive steps" in errors[0]
    assert "Traceback" not in err
    records = train_records(output_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/skipped_nonfinite"] == 1 for r in records)
    assert not (output_dir / "final_model").exists()


EVAL_OVERRIDES = [
    f"data.train_path={TRAIN_DATA}",
    f"data.val_path={VAL_DATA}",
    "validation.generate_strategy.max_length=8",
]


def test_opd_eval_of_a_checkpoint(lifecycle, tmp_path):
    checkpoint = lifecycle["reference"] / "checkpoints" / f"step_{TOTAL_STEPS}"
    output_dir = tmp_path / "eval"
    argv = ["eval", "--config", str(REPO_ROOT / TINY), f"output_dir={output_dir}", *EVAL_OVERRIDES,
            f"validation.model_path={checkpoint}"]
    process = Process("eval", argv, tmp_path / "process_output")
    status = process.wait()
    assert status == 0, process.output()
    for key in ("val/kl_reverse", "val/kl_forward", "val/mean_response_length", "val/accuracy"):
        assert key in process.stdout, process.output()
    metrics_file = output_dir / "logs" / "eval_metrics.json"
    assert str(metrics_file) in process.stdout
    written = json.loads(metrics_file.read_text())
    assert Path(written["model_path"]) == checkpoint / "policy"
    for key in ("val/kl_reverse", "val/kl_forward", "val/mean_response_length"):
        assert math.isfinite(written[key])
        printed = [line for line in process.stdout.splitlines() if line.split() and line.split()[0] == key]
        assert len(printed) == 1 and float(printed[0].split()[1]) == pytest.approx(written[key], abs=1e-4)
    assert written["val/kl_reverse"] > 1e-3  # the distilled student is not the teacher
    assert not (output_dir / "checkpoints").exists()
    assert not (output_dir / "final_model").exists()


@pytest.mark.parametrize("command", [("eval",), ("train", "val_only=true")], ids=["opd-eval", "train-val_only"])
def test_evaluating_the_teacher_gives_zero_kl(tmp_path, cli, command):
    output_dir = tmp_path / "eval"
    name, *extra = command
    status, out, err = cli(
        name, "--config", str(REPO_ROOT / TINY), f"output_dir={output_dir}", *EVAL_OVERRIDES, *extra,
        "validation.model_path=tiny:teacher",
    )
    assert status == 0, out + err
    assert "val/kl_reverse" in out and "val/kl_forward" in out
    written = json.loads((output_dir / "logs" / "eval_metrics.json").read_text())
    assert written["model_path"] == "tiny:teacher"
    assert abs(written["val/kl_forward"]) <= 1e-5, written
    assert abs(written["val/kl_reverse"]) <= 1e-5, written
    assert not (output_dir / "final_model").exists()
    assert not (output_dir / "checkpoints").exists()
    assert train_records(output_dir) == []
