"""The asynchronous schedules with packing, several teachers and a cross-tokenizer teacher (issue 35).

Each run is 2 steps on tiny models in one process and is compared with its reference, the
same schedule without the feature:

* ``one_step_off`` with ``training.sequence_packing`` trains the unpacked run's samples
  to the same losses and importance-ratio metrics (step 2 trains a stale batch, so the
  off-policy correction is exercised), with a full-vocabulary teacher (scored by the
  trainer on the packed rows), a top-k teacher (scored ahead, its rows packed) and a
  cross-tokenizer teacher (scored ahead on rows; it re-tokenises each sequence).
* two routed teachers whose rows all go to one teacher, and a mixture that gives one
  teacher all the weight, equal that teacher alone under ``one_step_off`` and
  ``two_step_off`` (the group is scored ahead with ``score_async`` and cut per micro-batch).
* two routed teachers that each get rows, and a mixture, train packed as they train on
  right-padded rows, scored by the trainer (sync) or ahead (``one_step_off``).
* a cross-tokenizer teacher scored ahead under ``one_step_off`` (the whole batch at once)
  equals the same run with the trainer asking it for each micro-batch.

Several teachers' answers scored ahead also survive a checkpoint (round trip of the
schedule's state).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from opd_test_helpers import short_run_overrides

from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import RolloutSchedule, distillation_train
from opd.models.interfaces import TopKLogprobs
from opd.teachers.several_teachers import MixedSignal, RoutedPart, RoutedSignal
from opd.teachers.signals import signal_from_state, signal_rows, signal_to_state
from opd.utils.config import load_config

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TOPK = ["loss_fn.type=topk", "loss_fn.k=4"]
ROUTE_ALL_TO_A = [
    "model.teacher_model_path=null",
    "teachers.mode=route",
    "teachers.route_key=task",
    "teachers.default=a",
    "teachers.members=[{name: a, model_path: 'tiny:teacher'}, {name: b, model_path: 'tiny:student-b'}]",
]
MIX_ALL_A = [
    "model.teacher_model_path=null",
    "teachers.mode=mixture",
    "teachers.members=[{name: a, model_path: 'tiny:teacher', weight: 1.0}, "
    "{name: b, model_path: 'tiny:student-b', weight: 0.0}]",
]


def run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """The step records of a 2-step run (3 prompts a step, sampled) with ``overrides``."""
    base = [
        *short_run_overrides(tmp_path, name),
        "checkpointing.enabled=false",
        "training.batch_size=3",
        "training.micro_batch_size=2",
        "training.max_num_steps=2",
        "training.warmup_steps=0",
        "training.learning_rate=0.01",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8",
        "model.teacher_model_path=tiny:teacher",
        # On, so that the stale batch's weights are part of what must compose (auto leaves
        # it off for these losses).
        "training.off_policy_correction.enabled=true",
    ]
    config = load_config(MasterConfig, TINY_CONFIG, [*base, *overrides])
    distillation_train(setup(config))
    lines = (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train/loss" in record]


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """Runs the references share (the same overrides run once per module)."""
    done: dict[tuple[str, ...], list[dict]] = {}

    def shared(*overrides: str) -> list[dict]:
        if overrides not in done:
            done[overrides] = run(tmp_path_factory.mktemp("shared"), "run", *overrides)
        return done[overrides]

    return shared


def same_training(records: list[dict], reference: list[dict], keys: tuple[str, ...], rel: float) -> None:
    assert len(records) == len(reference) == 2
    for step, (record, expected) in enumerate(zip(records, reference, strict=True), start=1):
        assert record["train/mean_response_length"] == expected["train/mean_response_length"], f"step {step}"
        for key in keys:
            assert record[key] == pytest.approx(expected[key], rel=rel), f"step {step}: {key}"


CORRECTION = ("train/loss", "train/kl_forward", "train/is_ratio_mean", "train/is_abs_log_ratio_mean")


@pytest.mark.parametrize(
    "loss",
    [[], TOPK, [*TOPK, "teacher.cross_tokenizer=true"]],
    ids=["full_vocab", "topk_scored_ahead", "cross_tokenizer_scored_ahead"],
)
def test_one_step_off_packed_equals_one_step_off_unpacked(tmp_path, shared_runs, loss):
    padded = shared_runs("training.scheduler=one_step_off", *loss)
    packed = run(tmp_path, "packed", "training.scheduler=one_step_off", "training.sequence_packing=true", *loss)
    assert padded[1]["train/staleness_max"] == 1  # the correction weighs step 2's batch
    # Packed rows attend block-diagonally: the same loss up to float32 reordering.
    same_training(packed, padded, CORRECTION, rel=1e-4)


@pytest.mark.parametrize(
    ("scheduler", "group"),
    [("one_step_off", ROUTE_ALL_TO_A), ("two_step_off", ROUTE_ALL_TO_A), ("one_step_off", MIX_ALL_A)],
    ids=["route_one_step_off", "route_two_step_off", "mixture_one_step_off"],
)
def test_several_teachers_scored_ahead_equal_the_one_teacher_they_reduce_to(tmp_path, shared_runs, scheduler, group):
    alone = shared_runs(f"training.scheduler={scheduler}", *TOPK)
    several = run(tmp_path, "several", f"training.scheduler={scheduler}", *TOPK, *group)
    same_training(several, alone, ("train/loss", "train/kl_forward", "train/kl_reverse"), rel=1e-5)
    assert all(record["train/teacher/a/token_share"] == pytest.approx(1.0) for record in several)
    assert all(record["train/teacher/a/kl_forward"] == pytest.approx(record["train/kl_forward"]) for record in several)


def test_a_cross_tokenizer_teacher_scored_ahead_equals_it_scored_by_the_trainer(tmp_path, monkeypatch):
    cross = ["training.scheduler=one_step_off", *TOPK, "teacher.cross_tokenizer=true"]
    ahead = run(tmp_path, "ahead", *cross)
    # Reference: the same run with nothing scored ahead (the trainer asks for each micro-batch).
    monkeypatch.setattr(RolloutSchedule, "_start_teacher", lambda self, slot: None)
    in_trainer = run(tmp_path, "in_trainer", *cross)
    same_training(ahead, in_trainer, ("train/loss", "train/kl_forward", "train/kl_reverse"), rel=1e-5)


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """Training rows of two tasks, ``add`` and ``sub`` (the routing key)."""
    rows = []
    for i in range(6):
        x, y = 10 + 7 * i, 3 + i
        sign, answer, task = ("+", x + y, "add") if i % 2 else ("-", x - y, "sub")
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {x} {sign} {y}?"},
                    {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
                ],
                "ground_truth": str(answer),
                "task": task,
            }
        )
    path = tmp_path_factory.mktemp("tasks") / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ROUTE_SPLIT = [
    "model.teacher_model_path=null",
    "teachers.mode=route",
    "teachers.route_key=task",
    "teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, model_path: 'tiny:student-b'}]",
]
MIX_HALVES = [
    "model.teacher_model_path=null",
    "teachers.mode=mixture",
    "teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, model_path: 'tiny:student-b'}]",
]


@pytest.mark.parametrize(
    ("schedule", "group"),
    [
        (["training.scheduler=sync"], ROUTE_SPLIT),
        (["training.scheduler=one_step_off", *TOPK], ROUTE_SPLIT),
        (["training.scheduler=sync"], MIX_HALVES),
        (["training.scheduler=one_step_off", *TOPK], MIX_HALVES),
    ],
    ids=["route_sync_full_vocab", "route_one_step_off_topk", "mixture_sync_full_vocab", "mixture_one_step_off_topk"],
)
def test_several_teachers_packed_equal_several_teachers_unpacked(tmp_path, task_data, schedule, group):
    common = [f"data.train_path={task_data}", *schedule, *group]
    padded = run(tmp_path, "padded", *common)
    packed = run(tmp_path, "packed", *common, "training.sequence_packing=true")
    keys = (
        "train/loss",
        "train/kl_forward",
        "train/teacher/add/kl_forward",
        "train/teacher/sub/kl_reverse",
        "train/teacher/add/token_share",
    )
    same_training(packed, padded, keys, rel=1e-4)
    assert 0 < padded[0]["train/teacher/add/token_share"] < 1  # both teachers score


def _topk(rows: int, width: int, seed: int) -> TopKLogprobs:
    generator = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(rows, width, 3, generator=generator)
    ids = torch.randint(0, 50, (rows, width, 3), generator=generator)
    return TopKLogprobs(logprobs, ids, torch.randn(rows, width, generator=generator))


def _same(left, right) -> None:
    assert type(left) is type(right)
    if isinstance(left, RoutedSignal):
        assert left.batch_size == right.batch_size and len(left.parts) == len(right.parts)
        for mine, theirs in zip(left.parts, right.parts, strict=True):
            assert mine.teacher == theirs.teacher and torch.equal(mine.rows, theirs.rows)
            _same(mine.signal, theirs.signal)
    elif isinstance(left, MixedSignal):
        _same(left.mixed, right.mixed)
        assert torch.equal(left.weights, right.weights)
        for mine, theirs in zip(left.members, right.members, strict=True):
            _same(mine, theirs)
    else:
        for mine, theirs in zip((*left, left.rest_logprobs), (*right, right.rest_logprobs), strict=True):
            assert torch.equal(mine, theirs)


def test_several_teachers_answers_scored_ahead_are_cut_per_micro_batch_and_checkpointed():
    # Rows 0, 2, 3 went to teacher 0, row 1 to teacher 1 (a batch of 4, 5 positions).
    member_0, member_1 = _topk(3, 5, 0), _topk(1, 5, 1)
    routed = RoutedSignal(
        [RoutedPart(0, torch.tensor([0, 2, 3]), member_0), RoutedPart(1, torch.tensor([1]), member_1)], 4
    )
    micro_batch = BatchedDataDict(sample_index=torch.tensor([3, 1]), input_ids=torch.zeros(2, 4, dtype=torch.long))
    cut = signal_rows(routed, micro_batch)
    assert isinstance(cut, RoutedSignal) and cut.batch_size == 2
    assert [part.rows.tolist() for part in cut.parts] == [[0], [1]]  # batch row 3 is first, row 1 second
    assert torch.equal(cut.parts[0].signal[0], member_0.logprobs[2:3, :4])
    assert torch.equal(cut.parts[1].signal[1], member_1.ids[:, :4])

    mixed = MixedSignal(_topk(4, 5, 2), [_topk(4, 5, 3), _topk(4, 5, 4)], torch.rand(4, 2))
    cut_mixed = signal_rows(mixed, micro_batch)
    assert isinstance(cut_mixed, MixedSignal)
    assert torch.equal(cut_mixed.weights, mixed.weights[[3, 1]])
    assert torch.equal(cut_mixed.members[1].rest_logprobs, mixed.members[1].rest_logprobs[[3, 1], :4])

    for signal in (routed, mixed):
        _same(signal_from_state(signal_to_state(signal)), signal)
