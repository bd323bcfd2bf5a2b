"""Every pair of features that opd's config validation accepts runs 2 steps on tiny models.

The axes and their values are those of ``tests/feature_matrix.py`` (issue 35): the loss,
the teacher, the cluster placement, the scheduler, the rollout engine, LoRA, packing,
context distillation, the validation baselines, λ, and the environment (multi-turn
episodes with the calculator, each episode's first turn a call). Which pairs are accepted is read from
the validator when the tests run, so a refusal removed from it adds its pairs here
without an edit. A covering array (:func:`feature_matrix.combination_runs`) sets every accepted
pair in a few runs, each of which sets one value on every axis:

* the in-process runs (the default suite): no cluster, HF rollouts;
* the cluster runs (``slow``: one Ray cluster each time the slow tier runs): every
  accepted pair with a cluster placement, each run against the same run in one process;
* the vLLM runs: where vLLM is installed, else skipped.

Every run ends its 2 steps with finite losses and a student whose weights moved, and a
run with the validation baselines logs the teacher's baseline. Where a reference exists
the run equals it (float32, within the rounding bound of ``opd_float_tolerance.metric_tolerance``;
its baselines exactly): a cluster run equals
the same run in one process; two routed teachers with every row routed to one equal that
teacher alone; a teacher served over opd's protocol equals the same teacher in process.

The specification's case at scale (split pools, HF rollout workers standing in for vLLM,
one_step_off, packing, a pooled teacher with the exact loss, λ = 0.5) is one more cluster
run, equal to the same run in one process.
"""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path

import feature_matrix as fm  # tests/ is on sys.path (tests/conftest.py)
import pytest
import torch
from opd_float_tolerance import METRIC_ZERO, metric_tolerance, tiny_student_entries
from opd_test_helpers import first_turn_calls_the_tool
from safetensors.torch import load_file

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config

STEPS = 2
COMPARED = ("train/loss", "train/grad_norm")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
"""Every episode's first turn with ``environment = tool`` (the student's later turns are its own)."""


# ------------------------------------------------------------------------------ shared fixtures


def _rows(count: int, start: int) -> list[dict]:
    """Arithmetic chats with a ground truth and a ``task`` field (``add`` / ``sub``: the routed teachers a / b)."""
    rows = []
    for i in range(start, start + count):
        x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
        sign, answer, task = ("-", x - y, "sub") if i % 2 else ("+", x + y, "add")
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {x} {sign} {y}?"},
                    {"role": "assistant", "content": f"{x} {sign} {y} = {answer}."},
                ],
                "ground_truth": str(answer),
                "task": task,
            }
        )
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("pairs_data")
    paths = {"train": directory / "train.jsonl", "val": directory / "val.jsonl"}
    for path, (count, start) in zip(paths.values(), [(16, 0), (4, 100)]):
        path.write_text("".join(json.dumps(row) + "\n" for row in _rows(count, start)))
    return paths


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory) -> str:
    """The tiny teacher's shape with a BPE tokenizer of its own (other merges, other vocabulary)."""
    from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer

    texts = [
        f"<|im_start|>user\nWhat is {a} - {b}?<|im_end|>\n<|im_start|>assistant\n{a} - {b} = {a - b}.<|im_end|>\n"
        for a in range(10, 90, 3)
        for b in (3, 8)
    ]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    directory = tmp_path_factory.mktemp("other_tokenizer") / "teacher"
    build_model_for_tokenizer("teacher", tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def served_url():
    """``opd serve-teacher``'s app serving the tiny teacher (``tiny:teacher``) on a free local port
    (sequences up to 2048 tokens: an episode's prompt lists the tools)."""
    from opd_test_helpers import RunningServer

    from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
    from opd.teachers.scoring import PromptScorer
    from opd.teachers.served.server import TeacherService

    tokenizer = build_tiny_tokenizer()
    service = TeacherService(
        PromptScorer(build_tiny_model("teacher").eval(), len(tokenizer)), tokenizer, "tiny-teacher", 128, 2048
    )
    running = RunningServer(service)
    yield f"http://127.0.0.1:{running.port}"
    running.stop()


@pytest.fixture(scope="module")
def resources(served_url, other_tokenizer_teacher) -> fm.Resources:
    return fm.Resources(served_url=served_url, other_tokenizer_teacher=other_tokenizer_teacher)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, str]]]:
    return fm.combination_runs()


@pytest.fixture(scope="module")
def initial_student() -> dict[str, torch.Tensor]:
    from opd.models.tiny import build_tiny_model

    return {name: tensor.detach().clone() for name, tensor in build_tiny_model("student").state_dict().items()}


# ------------------------------------------------------------------------------ one run


def run_overrides(output_dir: Path, data: dict[str, Path]) -> list[str]:
    """What every run of this file shares: 2 steps of 4 greedy prompts, small validation data, no checkpoints."""
    return [
        f"output_dir={output_dir}",
        f"data.train_path={data['train']}",
        f"data.val_path={data['val']}",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "validation.batch_size=4",
        "validation.generate_strategy.max_length=6",
        "logger.console=false",
        f"training.max_num_steps={STEPS}",
        "training.batch_size=4",
        "training.micro_batch_size=2",
        "training.save_freq=0",
        "training.val_freq=0",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.decoding_method=greedy",
        "distillation.generate_strategy.max_length=8",
    ]


_RECORDS: dict[tuple[str, ...], list[dict]] = {}
"""The logged records of this module's runs so far, by their overrides less ``output_dir``."""


def train(
    choice: fm.Choice,
    resources: fm.Resources,
    data: dict[str, Path],
    output_dir: Path,
    *extra: str,
    reuse: bool = False,
) -> list[dict]:
    """Runs the choice (2 steps) and returns its logged records.

    With ``reuse``, a run this module already made with the same overrides (another test's:
    the in-process covering array holds the first served-teacher run, for one) is read
    instead of repeated; its records are those a new run would log (same config, same
    seeds, one process), but ``output_dir`` stays empty, so a caller that reads its files
    must not reuse.
    """
    overrides = [*fm.overrides_for(choice, resources), *run_overrides(output_dir, data), *extra]
    key = tuple(override for override in overrides if not override.startswith("output_dir="))
    if reuse and key in _RECORDS:
        return _RECORDS[key]
    config = load_config(MasterConfig, fm.TINY_CONFIG, overrides)
    components = setup(config)
    if fm.complete(choice)["environment"] == "tool":  # the tiny models never call a tool on their own
        first_turn_calls_the_tool(components.student_generation, components.tokenizer, CALL)
        for engine in components.teacher_generation:
            first_turn_calls_the_tool(engine.generation, engine.tokenizer, CALL)
    try:
        distillation_train(components)
    finally:
        components.close()
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    _RECORDS[key] = records
    return records


def steps_of(records: list[dict]) -> list[dict]:
    return [record for record in records if "train/loss" in record]


def check_run(choice: fm.Choice, records: list[dict], output_dir: Path, initial: dict[str, torch.Tensor]) -> None:
    """What every run must show: 2 steps, finite losses, moved weights, and the baselines it asked for."""
    steps = steps_of(records)
    assert [record["step"] for record in steps] == list(range(1, STEPS + 1)), "the steps logged"
    for record in steps:
        assert math.isfinite(record["train/loss"]), f"step {record['step']}: loss {record['train/loss']}"
    final = load_file(str(output_dir / "final_model" / "model.safetensors"))
    if fm.complete(choice)["engine"] == "vllm":  # a student of the demo's shape (see feature_matrix)
        from opd.models.tiny import build_tiny_model

        initial = {name: tensor.detach() for name, tensor in build_tiny_model("demo-student").state_dict().items()}
    assert set(final) <= set(initial), "the final model's weights are not the student's"
    moved = [name for name, tensor in final.items() if not torch.equal(tensor, initial[name])]
    assert moved, "the student's weights did not change"
    if fm.complete(choice)["baselines"] == "on":
        assert baselines_of(records), "no teacher baseline"
    if fm.complete(choice)["environment"] == "tool":  # each on-policy step: a call, its answer, a second turn
        for record in steps:
            if record["train/on_policy"]:
                assert (record["env/turns"], record["env/success_share"]) == (2.0, 1.0), f"step {record['step']}"
        for key, value in baselines_of(records).items():
            if key.endswith("_turns"):
                assert value == 2.0, f"the baseline's episodes: {key}"


def baselines_of(records: list[dict]) -> dict[str, float]:
    """The validation baselines a run logged (``val/teacher_*``, ``val/baseline_*``)."""
    prefixes = ("val/teacher_", "val/baseline_")
    return {key: value for record in records for key, value in record.items() if key.startswith(prefixes)}


def assert_same_steps(actual: list[dict], expected: list[dict], what: str) -> None:
    assert len(actual) == len(expected) == STEPS, what
    for mine, reference in zip(actual, expected, strict=True):
        # The same sums in another order (ranks, a served teacher's float32 wire): a rounding bound per step.
        tolerance = metric_tolerance(mine["step"], tiny_student_entries())
        for key in COMPARED:
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (
                f"{what}, step {mine['step']} {key}: {mine[key]!r} against the reference's {reference[key]!r}"
            )


def run_all(group: list[dict[str, str]], body) -> None:
    """Runs ``body(index, run)`` for every run of a group and fails once, naming every run that failed."""
    failures = []
    for index, choice in enumerate(group):
        try:
            body(index, choice)
        except Exception as error:  # every run is reported, not only the first to fail
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            failures.append(f"{fm.label(choice)}: {last[:600]}")
    assert not failures, f"{len(failures)} of {len(group)} runs failed:\n" + "\n".join(failures)


# ------------------------------------------------------------------------------ the covering array


def test_the_quick_tree_is_the_loaders():
    """The covering array validates through a quick copy of the loader: it refuses what ``load_config`` refuses."""
    choices = [
        {"loss": "sampled_token"},  # another loss variant: the tiny config's kl_type is dropped
        {"teacher": "route", "lora": "on", "baselines": "on", "lambda": "0.5"},  # lists and new sections; refused
        {"teacher": "cross_tokenizer"},  # its own loss
        {"loss": "hybrid_full_vocab", "teacher": "cross_tokenizer"},  # the loss axis wins; refused
        {"cluster": "split_pool", "scheduler": "one_step_off", "packing": "on"},
    ]
    for choice in choices:
        assert fm.refusal(choice) == fm.loader_refusal(choice), fm.label(choice)


def test_the_runs_set_every_accepted_pair_and_are_each_accepted(runs):
    accepted = set(fm.accepted_pairs())
    assert accepted, "the validator accepts no pair"
    covered = {pair for group in runs.values() for run in group for pair in fm.pairs_of(run)}
    assert accepted <= covered, sorted(accepted - covered)
    for group in runs.values():
        for run in group:
            assert fm.refusal(run) is None, fm.label(run)
    assert all(run["cluster"] == "none" and run["engine"] == "hf" for run in runs["in_process"])
    assert all(run["cluster"] != "none" and run["engine"] == "hf" for run in runs["cluster"])


def test_every_accepted_pair_runs_in_process(runs, resources, data, initial_student, tmp_path):
    def body(index: int, choice: dict[str, str]) -> None:
        output_dir = tmp_path / f"run{index}"
        check_run(choice, train(choice, resources, data, output_dir), output_dir, initial_student)

    run_all(runs["in_process"], body)


def _first_with(group: list[dict[str, str]], axis: str, name: str, fallback: dict[str, str]) -> dict[str, str]:
    return next((run for run in group if run[axis] == name), fm.complete(fallback))


def test_two_routed_teachers_with_every_row_on_one_equal_that_teacher_alone(runs, resources, data, tmp_path):
    # Routing does not meet the environment (each row's teacher scores its whole episode): a
    # run without it keeps this comparison cheap (an episode's prompt lists the tools).
    single_turn = [run for run in runs["in_process"] if run["environment"] == "none"]
    routed = _first_with(single_turn, "teacher", "route", {"teacher": "route"})
    alone = {**routed, "teacher": "local"}  # member a is tiny:teacher, the local teacher
    if fm.refusal(alone) is not None:  # the run's other features need several teachers: compare routing alone
        routed = fm.complete({"teacher": "route"})
        alone = fm.complete({"teacher": "local"})
    every_row_on_a = "teachers.route_map={add: a, sub: a}"
    actual = steps_of(train(routed, resources, data, tmp_path / "routed", every_row_on_a, reuse=True))
    expected = steps_of(train(alone, resources, data, tmp_path / "alone", reuse=True))
    assert_same_steps(actual, expected, f"{fm.label(routed)} with every row on teacher a")


def test_a_teacher_served_over_opds_protocol_equals_it_in_process(runs, resources, data, tmp_path):
    served = _first_with(runs["in_process"], "teacher", "served", {"teacher": "served"})
    local = {**served, "teacher": "local"}
    actual = train(served, resources, data, tmp_path / "served", reuse=True)
    expected = train(local, resources, data, tmp_path / "local", reuse=True)
    assert_same_steps(steps_of(actual), steps_of(expected), fm.label(served))
    assert baselines_of(actual) == baselines_of(expected), f"{fm.label(served)}: the baselines"


# ------------------------------------------------------------------------------ on a Ray cluster


# ``ray_cluster`` (tests/conftest.py): a private local Ray cluster of 4 CPU slots (trainer, rollout, two teacher pools).


def on_cluster_and_in_process(choice, resources, data, initial, output_dir: Path) -> None:
    """The run on the cluster passes :func:`check_run` and equals the same run in one process."""
    records = train(choice, resources, data, output_dir / "cluster")
    check_run(choice, records, output_dir / "cluster", initial)
    in_process = {**choice, "cluster": "none"}
    problem = fm.refusal(in_process)
    assert problem is None, f"no in-process reference: {fm.first_line(problem or '')}"
    expected = train(in_process, resources, data, output_dir / "process", reuse=True)
    assert_same_steps(steps_of(records), steps_of(expected), f"{fm.label(choice)} against one process")
    assert baselines_of(records) == baselines_of(expected), f"{fm.label(choice)}: the baselines against one process"


@pytest.mark.slow
def test_every_accepted_pair_with_a_cluster_runs_and_equals_one_process(
    runs, resources, data, initial_student, ray_cluster, tmp_path
):
    run_all(
        runs["cluster"],
        lambda index, choice: on_cluster_and_in_process(
            choice, resources, data, initial_student, tmp_path / f"run{index}"
        ),
    )


@pytest.mark.slow
def test_the_specification_case_at_scale_runs_and_equals_one_process(
    resources, data, initial_student, ray_cluster, tmp_path
):
    """Split pools, HF rollout workers for vLLM, one_step_off, packing, a pooled exact-loss teacher, λ = 0.5."""
    on_cluster_and_in_process(fm.complete(fm.SPEC_AT_SCALE), resources, data, initial_student, tmp_path)


# ------------------------------------------------------------------------------ with vLLM


def test_every_accepted_pair_with_vllm_runs(runs, resources, data, initial_student, request, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/install_vllm_env.sh)")
    if any(run["cluster"] != "none" for run in runs["vllm"]):
        request.getfixturevalue("ray_cluster")

    def body(index: int, choice: dict[str, str]) -> None:
        output_dir = tmp_path / f"run{index}"
        check_run(choice, train(choice, resources, data, output_dir), output_dir, initial_student)

    run_all(runs["vllm"], body)
