"""Every config shipped in ``examples/configs/`` starts, validates and trains one step.

A shipped config that cannot run is a broken promise to the user who copies it. Each
config is run here as its command would run it (``opd train`` / ``opd sft`` / ``opd
generate``, in process), with only what this machine cannot have replaced: the hub's
models by tiny local ones, the hub's data by the repo's arithmetic task, a vLLM engine by
the HF one, and sizes cut so that one step and a validation take seconds. Everything
else (the loss, the teacher kind, the sampling, the validation settings) is the config's
own, and validation runs at the start, before step 1, and at the end.

The teacher kinds covered: in process (``demo``, ``distillation_tiny``, the spec's
``distillation_math``), a frozen copy of the student reading a teacher-only context
(``context_demo``), two routed teachers (``two_teachers_demo``), and a served top-k teacher
(``distillation_math_served``: opd's teacher server on 127.0.0.1 with the API key the
config names). The vLLM engine of the served config runs in ``tests/with_vllm``.

``distillation_math_cluster.yaml`` (8 GPUs) cannot train here: its case is ``opd plan``, the
dry run of its trainer at the real shapes on fake tensors, checked against the shapes'
arithmetic.

A new file in ``examples/configs/`` fails :func:`test_every_shipped_config_has_a_case`
until it gets a case here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, RunningServer, json_from_a_process_of_its_own, load_script

from opd.cli import main as opd_main

CONFIGS = REPO_ROOT / "examples" / "configs"
ARITHMETIC = REPO_ROOT / "examples" / "data" / "arithmetic"
SERVED_MODEL = "Qwen/Qwen2.5-32B-Instruct"  # distillation_math_served.yaml's teacher.remote.model
API_KEY_ENV = "OPD_TEACHER_KEY"  # ... and its teacher.remote.api_key_env

# The specification's hub models and data, replaced by tiny local ones.
DEMO_MODELS = REPO_ROOT / "examples" / "demo" / "models"
TINY_PAIR = ["model.teacher_model_path=tiny:teacher", "model.student_model_path=tiny:student"]
LOCAL_MATH_DATA = [f"data.train_path={ARITHMETIC / 'train.jsonl'}", "data.val_holdout=4"]
# One step, validation at the start and at the end on a few prompts, short answers.
ONE_STEP = [
    "training.max_num_steps=1",
    "training.val_freq=0",
    "training.save_freq=0",
    "validation.val_at_start=true",
    "validation.val_at_end=true",
    "validation.batch_size=4",
    "validation.generate_strategy.max_length=12",
    "data.max_val_examples=4",
    "data.max_train_examples=16",
]
SHORT_ROLLOUTS = ["distillation.generate_strategy.max_length=12", "training.batch_size=4"]


@dataclass(frozen=True)
class Case:
    """How one shipped config is run here.

    Attributes:
        command: the ``opd`` command the config is written for (``plan``: its dry run instead).
        overrides: what this machine cannot have, and the sizes of one short step.
        served: the teacher is served (opd's server on 127.0.0.1 with a tiny teacher).
    """

    command: str
    overrides: list[str] = field(default_factory=list)
    served: bool = False


CASES = {
    "distillation.yaml": Case(
        "train",
        [
            *TINY_PAIR,
            *LOCAL_MATH_DATA,
            "data.data_format=math_cl",
            "data.prompt_file=examples/prompts/math_think_answer.txt",
            *ONE_STEP,
            *SHORT_ROLLOUTS,
        ],
    ),
    "distillation_tiny.yaml": Case("train", [*ONE_STEP, *SHORT_ROLLOUTS]),
    "demo.yaml": Case("train", [*ONE_STEP, *SHORT_ROLLOUTS]),
    "distillation_math.yaml": Case("train", [*TINY_PAIR, *LOCAL_MATH_DATA, *ONE_STEP, *SHORT_ROLLOUTS]),
    "distillation_math_served.yaml": Case(
        "train",
        [
            "model.student_model_path=tiny:student",
            *LOCAL_MATH_DATA,
            *ONE_STEP,
            *SHORT_ROLLOUTS,
            "generation.backend=hf",
        ],
        served=True,
    ),
    "context_demo.yaml": Case("train", [*ONE_STEP, *SHORT_ROLLOUTS]),
    "two_teachers_demo.yaml": Case("train", [*ONE_STEP, *SHORT_ROLLOUTS]),
    "sft.yaml": Case("sft", [*ONE_STEP, "training.batch_size=4"]),
    # prepare_models.py makes teacher_init before it runs this config; the demo teacher stands in.
    "sft_arithmetic.yaml": Case(
        "sft", ["model.model_path=examples/demo/models/teacher", *ONE_STEP, "training.batch_size=4"]
    ),
    # The tool demo's configs read examples/data/tool_multiplication (written by its prepare
    # script); the test writes a small copy of that task (the tool_task fixture).
    "tool_demo.yaml": Case("train", [*ONE_STEP, *SHORT_ROLLOUTS, "training.micro_batch_size=4"]),
    "sft_tool.yaml": Case(
        "sft", ["model.model_path=examples/demo/models/tool_teacher", *ONE_STEP, "training.batch_size=4"]
    ),
    "distillation_math_cluster.yaml": Case("plan", ["--json", "--quick"]),
    # The real-model example's models are SmolLM2 and a student pruned from it (its runner
    # makes them); tiny ones stand in, on its own task written by its script (capitals_task).
    "real_model.yaml": Case("train", [*TINY_PAIR, *ONE_STEP, *SHORT_ROLLOUTS]),
    # Its self-distillation: the tiny student is its own live teacher, reading the reference answer.
    "real_model_self.yaml": Case("train", ["model.student_model_path=tiny:student", *ONE_STEP, *SHORT_ROLLOUTS]),
    # Its cross-tokenizer pair (SmolLM2 teaching Gemma 3): the demo's student and its teacher of
    # another tokenizer stand in, with the config's own Gemma turn markup.
    "real_model_cross_tokenizer.yaml": Case(
        "train",
        [
            f"model.teacher_model_path={DEMO_MODELS / 'teacher_other_tokenizer'}",
            f"model.student_model_path={DEMO_MODELS / 'student'}",
            *ONE_STEP,
            *SHORT_ROLLOUTS,
        ],
    ),
    "generate_demo.yaml": Case("generate", ["data.max_train_examples=4", "generate.generate_strategy.max_length=12"]),
    "generate_math.yaml": Case(
        "generate",
        [*TINY_PAIR, *LOCAL_MATH_DATA, "data.max_train_examples=4", "generate.generate_strategy.max_length=12"],
    ),
}


def test_every_shipped_config_has_a_case():
    assert sorted(path.name for path in CONFIGS.glob("*.yaml")) == sorted(CASES)


@pytest.fixture(scope="module")
def served_teacher(tmp_path_factory):
    """opd's teacher server with the tiny teacher on 127.0.0.1, asking for an API key."""
    from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
    from opd.teachers.scoring import PromptScorer
    from opd.teachers.served.server import TeacherService

    tokenizer = build_tiny_tokenizer()
    service = TeacherService(
        PromptScorer(build_tiny_model("teacher").eval(), len(tokenizer)), tokenizer, SERVED_MODEL, 128, 2048
    )
    running = RunningServer(service, api_key="shipped-config-key")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def hint_data():
    """context_demo.yaml's data (``examples/data/arithmetic_hints/``), written as its prepare script does."""
    if not (REPO_ROOT / "examples" / "data" / "arithmetic_hints" / "val.jsonl").is_file():
        load_script(REPO_ROOT / "examples" / "demo" / "prepare_context_demo.py", register=True).write_hint_data()


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory) -> Path:
    """A small copy of the tool demo's task, written by ``examples/data/make_tool_task.py``."""
    import sys

    out_dir = tmp_path_factory.mktemp("tool_task")
    path = REPO_ROOT / "examples" / "data" / "make_tool_task.py"
    module = load_script(path)
    argv = sys.argv
    sys.argv = [str(path), "--out-dir", str(out_dir), "--train-size", "16", "--val-size", "4", "--test-size", "4"]
    try:
        module.main()
    finally:
        sys.argv = argv
    return out_dir


@pytest.fixture(scope="module")
def capitals_task(tmp_path_factory) -> Path:
    """The real-model example's task, written by ``examples/real_model/make_capitals_task.py``."""
    out_dir = tmp_path_factory.mktemp("capitals")
    load_script(REPO_ROOT / "examples" / "real_model" / "make_capitals_task.py").write_task(out_dir)
    return out_dir


TOOL_TASK_FILES = {
    "tool_demo.yaml": ("train.jsonl", "val.jsonl"),
    "sft_tool.yaml": ("teacher_sft.jsonl", "teacher_sft.jsonl"),
}
"""Each tool demo config's training and validation files in the small task (the demo itself validates neither)."""


def metric_records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def check_cluster_plan(plan: dict) -> None:
    """The 8-GPU spec config's plan against the arithmetic of its shapes."""
    world = plan["world_size"]
    assert world == 8 and plan["ranks_equal"]
    (rank,) = plan["ranks"]["off"]  # the configured variant alone (--quick): no activation checkpointing
    # fp32 master weights, gradients and two Adam moments, each 1/8 of the student; the
    # teacher's 16-bit weights 1/8 each (a step counter per tensor is the only extra).
    assert rank["student_parameters"] == plan["student_parameters_total"] * 4 // world
    assert rank["student_gradients"] == rank["student_parameters"]
    assert rank["optimizer_state"] == pytest.approx(2 * rank["student_parameters"], rel=1e-5)
    assert rank["teacher_parameters"] == plan["teacher_parameters_total"] * 2 // world
    assert plan["student_parameters_total"] == 1_543_714_304  # Qwen2.5-1.5B, tied head
    assert plan["teacher_parameters_total"] == 32_763_876_352  # Qwen2.5-32B (152,064 vocabulary rows, untied)
    # A step of 2 × 3,072 tokens holds more than its standing memory: activations of 28 layers.
    assert rank["transient"] > 5 * 1024**3 and rank["peak"] == rank["standing"] + rank["transient"]
    for device, size in plan["devices"].items():
        # The verdict counts what the caching allocator reserves: the allocated peak times the stated factor.
        assert plan["reserved_peaks"]["off"] == math.ceil(rank["peak"] * plan["reserved_factor"])
        assert plan["verdicts"][device]["off"] == (plan["reserved_peaks"]["off"] + plan["runtime_reserve"] <= size)
        kept, offloaded = plan["engine"][device]["kept"], plan["engine"][device]["offloaded"]
        # vLLM sizes its KV cache within its own share (what the trainer keeps must fit beside it: the check below).
        assert kept == offloaded and kept["share"] == int(size * 0.3)
        assert kept["kv_cache"] == kept["share"] - kept["weights"] - kept["activations"]
        assert kept["kv_tokens"] == kept["kv_cache"] // plan["kv_bytes_per_token"]
        assert plan["trainer_resident"]["offloaded"] == rank["student_parameters"]  # the refit reads the shard
        beside_share = plan["colocated_checks"][device]["kept"]
        assert beside_share["parts"][1]["size"] == kept["share"] and beside_share["total"] > kept["share"]


def run_plan(name: str, overrides: list[str]) -> dict:
    """``opd plan`` in a process of its own (the dry run registers a stand-in accelerator for its process)."""
    return json_from_a_process_of_its_own(["-m", "opd", "plan", "--config", str(CONFIGS / name), *overrides])


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_shipped_config_starts_validates_and_trains_one_step(name, tmp_path, request, monkeypatch):
    case = CASES[name]
    if case.command == "plan":
        check_cluster_plan(run_plan(name, case.overrides))
        return
    overrides = list(case.overrides)
    if case.served:
        server = request.getfixturevalue("served_teacher")
        monkeypatch.setenv(API_KEY_ENV, "shipped-config-key")
        overrides.append(f"teacher.remote.url={server.url}")
    if name == "context_demo.yaml":
        request.getfixturevalue("hint_data")
    if name in ("real_model.yaml", "real_model_self.yaml", "real_model_cross_tokenizer.yaml"):
        task = request.getfixturevalue("capitals_task")
        overrides += [f"data.train_path={task / 'train.jsonl'}", f"data.val_path={task / 'val.jsonl'}"]
    if name in TOOL_TASK_FILES:
        task = request.getfixturevalue("tool_task")
        train, val = TOOL_TASK_FILES[name]
        overrides += [f"data.train_path={task / train}", f"data.val_path={task / val}"]
    output_dir = tmp_path / "run"
    if case.command == "generate":
        answers = tmp_path / "answers.jsonl"
        overrides += [f"output_dir={output_dir}", f"generate.output_path={answers}"]
        assert opd_main([case.command, "--config", str(CONFIGS / name), *overrides]) == 0
        assert answers.is_file()
        return
    overrides.append(f"output_dir={output_dir}")
    monkeypatch.chdir(REPO_ROOT)  # the configs name their files relative to the checkout
    assert opd_main([case.command, "--config", str(CONFIGS / name), *overrides]) == 0

    records = metric_records(output_dir)
    validations = [r for r in records if "val/mean_response_length" in r]
    assert [r["step"] for r in validations] == [0, 1], validations  # at the start and at the end
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 1 and math.isfinite(losses[0])
    if case.command == "train":
        # Every teacher here can be compared with: the KL is reported at each validation.
        for record in validations:
            assert math.isfinite(record["val/kl_forward"]) and math.isfinite(record["val/kl_reverse"]), record
