"""What on-policy data buys: λ × fixed-data source × KL direction, against SFT, across seeds (issue 23).

Every run distils a student from a teacher with ``examples/configs/demo.yaml`` and a few
changes (or fine-tunes it with ``opd sft``). Four scenarios (``--scenarios``):

* ``demo``: the README demo's pair (``examples/demo/models/{teacher,student}``) on 3-digit
  addition;
* ``student_small`` and ``student_tiny``: a capacity gap, one-layer students of hidden size
  64 and 32 against the demo teacher;
* ``5digit``: a harder task, 5-digit addition, with a teacher fine-tuned on it and the demo
  student fine-tuned briefly to write its trace format.

The extra models come from ``examples/demo/prepare_study_models.py``. The fixed data of a
λ < 1 step (and the SFT data) come from one of three sources, written for each scenario's
20,000 training problems:

* ``teacher_samples``: the teacher's own greedy answers, made with ``opd generate``; the
  time that took is measured and charged per answer a run trains on;
* ``reference``: the same problems' reference solutions in another valid trace format
  (``examples/data/make_arithmetic_task.py --trace reference``);
* ``answer_only``: no trace, only the answer tags (``--trace answer_only``).

**One run per setting and seed gives both budgets.** Each run trains for
``--run-seconds`` of training time (validation excluded) with a constant learning rate
after 10 warm-up steps, and evaluates the test split (greedy, 256 problems, accuracy and
KL to the teacher) every ``--eval-every`` steps. Its learning curve is read at **equal
steps** (``--steps``) and at **equal wall-clock** (``--time-budget-s`` of *charged* time:
generation, teacher and update time, plus one batch of teacher-sample generation for
every step that trained on teacher samples, from the run's own λ coin), interpolated
linearly between the evaluations around it.

**The grid is sampled** (``--priority``): priority 1 is what the headline compares on the
demo's pair: λ = 1, λ = 0 with each source, SFT on the teacher samples and on the
reference solutions, forward KL. Priority 2 adds λ = 0.5 with each source, reverse KL
(λ = 1 and λ = 0 on the reference solutions) and on-policy sampling at temperature 0.1
(the specification's) and 1 instead of greedy. Priority 3 adds greedy and temperature 0.1
with a decaying learning rate (10 warm-up steps, cosine to 0 at ``COSINE_STEPS``) instead
of a constant one. The other scenarios run λ = 1, λ = 0 with
the teacher samples and SFT on them. Runs go ``--jobs`` at a time, one thread each;
priority 1 first, seed by seed, so a study cut short has whole rows. The default
(``--priority 1``, every scenario) is the part that fits the issue's budget of about two
hours on 2 CPU cores; ``--priority 2`` adds the demo pair's 21 other runs.

The study is resumable: each run's curve is written to ``<out>/runs/<name>.json``
(``benchmarks/results/lambda_study/runs/`` by default, kept in the repository), and a
rerun with the same ``--run-seconds`` and ``--eval-every`` reuses it (``--only`` selects
runs by substrings of their names). The tables give, per scenario and setting, the mean ±
standard deviation over the seeds; a ``*`` marks a cell some seeds did not reach. The
last line is machine-readable, for the demo's pair, the best fixed-data source and the
best SFT source at equal wall-clock:

    lambda_study equal_time lambda1=<mean>+-<std> lambda0=<mean>+-<std> sft=<mean>+-<std>

The tasks are written first where they are missing (``examples/data/make_arithmetic_task.py``).

Usage: ``python benchmarks/lambda_study.py [--scenarios demo ...] [--priority 1|2] [--seeds 0 1 2]
[--steps 150] [--time-budget-s 200] [--run-seconds 240] [--eval-every 50] [--jobs 2] [--only TEXT ...]
[--eval-examples N] [--smoke]`` (``--eval-examples`` caps the test problems of every
evaluation; ``--smoke``: two of the demo pair's runs for 3 s each, in a temporary
directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import arithmetic_task, parse_arguments  # noqa: E402
from sweep_lambda_kl import (  # noqa: E402  (the sweep's run helpers, shared)
    CONFIG,
    NO_STEP_CAP,
    SFT_CONFIG,
    TASK,
    run_opd,
)

SOURCES = ("teacher_samples", "reference", "answer_only")
TEMPERATURES = {
    "temp0.1": (
        "distillation.generate_strategy.decoding_method=top_p",
        "distillation.generate_strategy.temperature=0.1",
    ),
    "temp1": ("distillation.generate_strategy.decoding_method=top_p", "distillation.generate_strategy.temperature=1.0"),
}
MODELS = REPO / "examples" / "demo" / "models"
BATCH = 32  # demo.yaml's training.batch_size, also the SFT baselines'


@dataclass(frozen=True)
class Setting:
    """One row of a table: a method and its overrides (the seed is added per run).

    Attributes:
        name: the row's name, e.g. ``lambda0.5_reference_forward``.
        kind: ``distill`` (``opd train``) or ``sft`` (``opd sft``).
        overrides: config overrides of the method.
        source: the fixed data it reads (None: on-policy only).
        priority: 1 for the rows the headline compares, 2 for the rest (``--priority``).
    """

    name: str
    kind: str
    overrides: tuple[str, ...]
    source: str | None
    priority: int = 1


@dataclass(frozen=True)
class Scenario:
    """A teacher, a student and a task.

    Attributes:
        name: the scenario's name (``demo``, ``student_small``, ``student_tiny``, ``5digit``).
        teacher: the teacher's model directory.
        student: the student's model directory.
        task: the directory with the task's train/val/test.jsonl (the teacher's trace format).
        digits: the operands' digits (the other sources are written with the same).
        max_length: the generation limit of rollouts and evaluations.
        sampled: whether only the sampled grid runs (see :func:`settings`).
    """

    name: str
    teacher: Path
    student: Path
    task: Path
    digits: int
    max_length: int
    sampled: bool

    def overrides(self) -> list[str]:
        """The overrides that put this scenario's lengths and test split into a run (SFT or distillation)."""
        return [
            f"data.val_path={self.task / 'test.jsonl'}",
            "data.max_val_examples=null",
            f"validation.generate_strategy.max_length={self.max_length}",
        ]


SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        Scenario("demo", MODELS / "teacher", MODELS / "student", TASK, 3, 96, sampled=False),
        # Capacity gap: one-layer students, hidden 64 and 32, against the demo teacher.
        Scenario("student_small", MODELS / "teacher", MODELS / "study_student_small", TASK, 3, 96, sampled=True),
        Scenario("student_tiny", MODELS / "teacher", MODELS / "study_student_tiny", TASK, 3, 96, sampled=True),
        # Harder task: 5-digit addition.
        Scenario(
            "5digit",
            MODELS / "study_teacher_5digit",
            MODELS / "study_student_5digit",
            REPO / "examples" / "data" / "arithmetic_5digit",
            5,
            128,
            sampled=True,
        ),
    )
}


COSINE_STEPS = 220
COSINE = ("training.lr_scheduler=cosine", f"training.max_num_steps={COSINE_STEPS}")
"""A decaying learning rate: 10 warm-up steps, then cosine decay to 0 at ``COSINE_STEPS`` (the run's last step)."""
RAMP_STEPS = 300
"""The λ ramp's length: λ goes from 0 at step 1 to 1 at this step (about two thirds of a 600 s run's steps on
the 5-digit task), then stays at 1."""


def _distill(name: str, lam: float | str, kl: str, source: str | None, priority: int, *extra: str) -> Setting:
    return Setting(name, "distill", (f"distillation.lambda={lam}", f"loss_fn.kl_type={kl}", *extra), source, priority)


def settings(scenario: Scenario) -> list[Setting]:
    """The grid of a scenario (see the module docstring for why it is sampled)."""
    core = [
        _distill("lambda1_forward", 1.0, "forward", None, 1),
        _distill("lambda0_teacher_samples_forward", 0.0, "forward", "teacher_samples", 1),
        Setting("sft_teacher_samples", "sft", (), "teacher_samples", 1),
    ]
    if scenario.sampled:
        # λ as a schedule (issue 37): teacher samples first, the student's own later.
        ramp = f"{{schedule: linear, start: 0.0, end: 1.0, steps: {RAMP_STEPS}}}"
        return [
            *core,
            _distill(f"lambda_ramp{RAMP_STEPS}_teacher_samples_forward", ramp, "forward", "teacher_samples", 2),
        ]
    return [
        *core,
        _distill("lambda0_reference_forward", 0.0, "forward", "reference", 1),
        _distill("lambda0_answer_only_forward", 0.0, "forward", "answer_only", 1),
        Setting("sft_reference", "sft", (), "reference", 1),
        *(_distill(f"lambda0.5_{source}_forward", 0.5, "forward", source, 2) for source in SOURCES),
        _distill("lambda1_reverse", 1.0, "reverse", None, 2),
        _distill("lambda0_reference_reverse", 0.0, "reverse", "reference", 2),
        *(
            _distill(f"lambda1_forward_{name}", 1.0, "forward", None, 2, *overrides)
            for name, overrides in TEMPERATURES.items()
        ),
        # Sampling against greedy with a decaying learning rate (issue 37): warm-up, then cosine to 0 at
        # COSINE_STEPS, a step count both reach inside --run-seconds 240 on 2 cores.
        _distill(f"lambda1_forward_cosine{COSINE_STEPS}", 1.0, "forward", None, 3, *COSINE),
        _distill(
            f"lambda1_forward_temp0.1_cosine{COSINE_STEPS}", 1.0, "forward", None, 3, *TEMPERATURES["temp0.1"], *COSINE
        ),
    ]


@dataclass
class Sources:
    """One scenario's fixed-data files (math-cl rows), and the teacher's generation time per answer."""

    paths: dict[str, Path] = field(default_factory=dict)
    seconds_per_answer: dict[str, float] = field(default_factory=dict)


def prepare_sources(out: Path, scenario: Scenario, prompts: int) -> Sources:
    """Writes (once) the scenario's three fixed-data sources for its first ``prompts`` training problems.

    The teacher's samples come from ``opd generate`` as chat rows; they are rewritten as
    math-cl rows (the answer as the worked solution), so every source and the test split
    share one format and one prompt.
    """
    sources = Sources()
    data = out / "data" / f"{scenario.teacher.name}-{scenario.task.name}"  # shared by the scenarios of one teacher
    for trace in ("reference", "answer_only"):
        directory = arithmetic_task(data / trace, scenario.digits, trace)
        sources.paths[trace] = directory / "train.jsonl"
        sources.seconds_per_answer[trace] = 0.0  # a dataset's own solutions cost nothing to make
    answers, meta = data / "teacher_samples.jsonl", data / "teacher_samples.json"
    if not meta.is_file() or json.loads(meta.read_text(encoding="utf-8"))["prompts"] != prompts:
        answers.unlink(missing_ok=True)
        start = time.perf_counter()
        run_opd(
            [
                "generate",
                "--config",
                str(REPO / "examples" / "configs" / "generate_demo.yaml"),
                f"generate.model_path={scenario.teacher}",
                f"data.train_path={scenario.task / 'train.jsonl'}",
                f"data.max_train_examples={prompts}",
                f"generate.output_path={answers}",
                f"generate.generate_strategy.max_length={scenario.max_length}",
                "generate.generate_strategy.decoding_method=greedy",
                "generate.max_attempts_per_prompt=null",
                "generate.progress_bar=false",
                "generate.batch_size=64",
            ],
            out / "logs" / f"generate_{data.name}.log",
        )
        seconds = time.perf_counter() - start
        rows = len(answers.read_text(encoding="utf-8").splitlines())
        meta.write_text(json.dumps({"prompts": prompts, "rows": rows, "seconds": seconds}), encoding="utf-8")
    math_cl = data / "teacher_samples_math_cl.jsonl"
    with open(answers, encoding="utf-8") as rows_in, open(math_cl, "w", encoding="utf-8") as rows_out:
        for line in rows_in:
            row = json.loads(line)
            rows_out.write(
                json.dumps(
                    {
                        "problem": row["problem"],
                        "ground_truth_answer": row["ground_truth"],
                        "solution": row["messages"][-1]["content"],
                    }
                )
                + "\n"
            )
    recorded = json.loads(meta.read_text(encoding="utf-8"))
    sources.paths["teacher_samples"] = math_cl
    sources.seconds_per_answer["teacher_samples"] = recorded["seconds"] / max(recorded["rows"], 1)
    return sources


def run_name(scenario: Scenario, setting: Setting, seed: int) -> str:
    return f"{scenario.name}/{setting.name}/seed{seed}"


def run_one(scenario: Scenario, setting: Setting, seed: int, args: argparse.Namespace, sources: Sources) -> dict:
    """One run, evaluated on the test split every ``--eval-every`` steps; returns its learning curve.

    The run stops after ``--run-seconds`` of training time (validation excluded). Each
    curve point carries the step, the training seconds so far and the *charged* seconds:
    training plus the teacher-sample generation the steps consumed (one batch of answers
    per fixed-data step of a distillation run, per SFT step).
    """
    name = run_name(scenario, setting, seed)
    output_dir = args.out / name
    log = args.out / "logs" / f"{name.replace('/', '_')}.log"
    per_batch = BATCH * sources.seconds_per_answer.get(setting.source or "", 0.0)
    common = [
        f"output_dir={output_dir}",
        "logger.console=false",
        "checkpointing.enabled=false",
        # Constant after warm-up: a run read at two budgets must have one schedule.
        "training.lr_scheduler=constant_with_warmup",
        "training.warmup_steps=10",
        f"training.val_freq={args.eval_every}",
        "validation.val_at_start=false",
        "validation.val_at_end=true",
        f"training.max_train_time_s={args.run_seconds}",
        f"training.max_num_steps={NO_STEP_CAP}",  # a setting with a decaying schedule sets its own
        f"training.seed={seed}",
        *scenario.overrides(),
        *([] if args.eval_examples is None else [f"data.max_val_examples={args.eval_examples}"]),
    ]
    data = (
        [f"data.train_path={sources.paths[setting.source]}"]
        if setting.source
        else [f"data.train_path={scenario.task / 'train.jsonl'}"]
    )
    if setting.kind == "distill":
        run_opd(
            [
                "train",
                "--config",
                str(CONFIG),
                *common,
                *data,
                *setting.overrides,
                f"model.student_model_path={scenario.student}",
                f"model.teacher_model_path={scenario.teacher}",
                f"distillation.generate_strategy.max_length={scenario.max_length}",
                # The tiny vocabulary gains nothing from compiling, and the compilation's
                # seconds would count against a short budget.
                "loss_fn.compile_kernels=false",
            ],
            log,
        )
    else:
        cap = int(args.run_seconds // per_batch) + 1 if per_batch else NO_STEP_CAP  # charged time ends it sooner
        run_opd(
            [
                "sft",
                "--config",
                str(SFT_CONFIG),
                *common,
                *data,
                f"model.model_path={scenario.student}",
                f"training.batch_size={BATCH}",
                "training.learning_rate=2.0e-3",
                "training.num_epochs=1000",
                f"training.max_num_steps={cap}",
            ],
            log,
        )
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "scenario": scenario.name,
        "setting": setting.name,
        "seed": seed,
        "run_seconds": args.run_seconds,
        "eval_every": args.eval_every,
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "jobs": args.jobs,
        "curve": learning_curve(records, setting.kind == "sft", per_batch),
    }


def learning_curve(records: list[dict], sft: bool, per_batch: float) -> list[dict]:
    """A run's evaluations, each with the training and the *charged* seconds spent before it.

    Args:
        records: the run's ``metrics.jsonl`` rows in order.
        sft: whether every step trained on the fixed data (an SFT run).
        per_batch: the teacher-sample generation seconds one batch of fixed data cost
            (0 for a source that costs nothing to make).

    Returns:
        One point per evaluation: ``step``, ``train_seconds``, ``charged_seconds`` (training
        plus ``per_batch`` for every step before it that trained on fixed data, from the
        run's own ``train/on_policy`` coin), ``accuracy`` and the KLs.
    """
    train_seconds = charged = 0.0
    curve = []
    for record in records:
        if "timing/step" in record:
            train_seconds += record["timing/step"]
            fixed_step = sft or not record.get("train/on_policy", 1)
            charged += record["timing/step"] + (per_batch if fixed_step else 0.0)
        if "val/accuracy" in record:
            curve.append(
                {
                    "step": record["step"],
                    "train_seconds": train_seconds,
                    "charged_seconds": charged,
                    "accuracy": record["val/accuracy"],
                    "kl_forward": record.get("val/kl_forward"),
                    "kl_reverse": record.get("val/kl_reverse"),
                }
            )
    return curve


def at_steps(result: dict, steps: int) -> dict | None:
    """The curve point at ``steps`` optimizer steps (None if the run did not get there)."""
    return next((point for point in result["curve"] if point["step"] == steps), None)


def at_time(result: dict, seconds: float) -> dict | None:
    """The curve at ``seconds`` of charged time, interpolated linearly between the evaluations around it.

    None if the run stopped short of it or has no evaluation before it. Interpolating
    keeps a method whose evaluations are further apart in time (slower steps) from being
    read at an earlier point than a faster one.
    """
    curve = result["curve"]
    if not curve or curve[-1]["charged_seconds"] < seconds or curve[0]["charged_seconds"] > seconds:
        return None
    after = next(index for index, point in enumerate(curve) if point["charged_seconds"] >= seconds)
    if after == 0 or curve[after]["charged_seconds"] == seconds:
        return curve[after]
    low, high = curve[after - 1], curve[after]
    share = (seconds - low["charged_seconds"]) / (high["charged_seconds"] - low["charged_seconds"])
    point = {"step": low["step"] + share * (high["step"] - low["step"]), "charged_seconds": seconds}
    for key in ("accuracy", "kl_forward", "kl_reverse"):
        both = (low[key], high[key])
        point[key] = None if None in both else both[0] + share * (both[1] - both[0])
    return point


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


SMOKE = {
    "scenarios": ["demo"],
    "seeds": [0],
    "only": ["teacher_samples"],
    "steps": 2,
    "time_budget_s": 2.0,
    "run_seconds": 3.0,
    "eval_every": 2,
    "teacher_prompts": 32,
    "eval_examples": 8,
    "out": None,
}
"""``--smoke``: the demo pair's λ = 0 on teacher samples and SFT on them (the study's data path), one seed, 3 s
each, 8 test problems per evaluation, in a temporary directory."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="the equal-steps budget (a multiple of --eval-every)")
    parser.add_argument("--time-budget-s", type=float, default=200.0, help="the equal wall-clock budget")
    parser.add_argument("--run-seconds", type=float, default=240.0, help="each run's training time")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--teacher-prompts",
        type=int,
        default=20000,
        help="training problems the teacher answers (all of them: the other sources have as many)",
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--priority", type=int, default=1, help="run the settings of this priority and below")
    parser.add_argument(
        "--only", nargs="+", default=None, help="run only the runs whose name contains one of these texts"
    )
    parser.add_argument(
        "--eval-examples", type=int, default=None, help="test problems per evaluation (default: the whole test split)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lambda_study")
    args = parse_arguments(parser, SMOKE)
    with contextlib.ExitStack() as stack:
        if args.out is None:  # --smoke keeps nothing
            args.out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="opd_lambda_study_smoke_")))
        study(args)


def study(args: argparse.Namespace) -> None:
    """Runs what is missing under ``args.out`` and prints the tables."""
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    scenarios = [SCENARIOS[name] for name in args.scenarios]
    for scenario in scenarios:
        missing = [str(path) for path in (scenario.teacher, scenario.student) if not (path / "config.json").is_file()]
        if missing:
            raise SystemExit(
                f"scenario {scenario.name}: no model at {', '.join(missing)}; "
                "run python examples/demo/prepare_study_models.py"
            )
        arithmetic_task(scenario.task, scenario.digits)
    wanted = [
        (scenario, setting, seed)
        for scenario in scenarios
        for setting in settings(scenario)
        for seed in args.seeds
        if setting.priority <= args.priority
        and (args.only is None or any(text in run_name(scenario, setting, seed) for text in args.only))
    ]
    # Priority 1 first, then seed by seed: a study cut short still has whole rows.
    wanted.sort(key=lambda item: (item[1].priority, item[2]))
    sources = {
        scenario.name: prepare_sources(args.out, scenario, args.teacher_prompts)
        for scenario in {item[0] for item in wanted}
    }

    def job(scenario: Scenario, setting: Setting, seed: int) -> dict:
        name = run_name(scenario, setting, seed)
        path = args.out / "runs" / f"{name.replace('/', '_')}.json"
        if path.is_file():  # reused only if it ran with this invocation's run length and eval spacing
            recorded = json.loads(path.read_text(encoding="utf-8"))
            if (recorded["run_seconds"], recorded["eval_every"]) == (args.run_seconds, args.eval_every):
                return recorded
        result = run_one(scenario, setting, seed, args, sources[scenario.name])
        path.write_text(json.dumps(result, indent=1), encoding="utf-8")
        last = result["curve"][-1]
        print(f"  done {name}: test accuracy {last['accuracy']:.3f} after {last['step']} steps", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda item: job(*item), wanted))
    print_tables(results, args, time.perf_counter() - start)


def print_tables(results: list[dict], args: argparse.Namespace, seconds: float) -> None:
    """One table per scenario (mean ± std over the seeds), then the headline line of the demo's pair."""
    print()
    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.jobs} runs at "
        f"a time (1 thread each); seeds {args.seeds}; this invocation {seconds / 60:.1f} min"
    )
    print(
        f"equal steps = {args.steps}; equal wall-clock = {args.time_budget_s:g} s charged (training, generation and "
        f"teacher time, plus the teacher-sample generation used); test split evaluated every {args.eval_every} steps"
    )
    summaries = {}
    for scenario in args.scenarios:
        group = [result for result in results if result["scenario"] == scenario]
        if group:
            summaries[scenario] = print_scenario(scenario, group, args)
    demo = summaries.get("demo")
    if demo is None:  # the headline compares the demo's pair only
        print("\n(no headline line: the demo's pair is not among --scenarios)")
        return

    def best(names: list[str]) -> tuple[float, float]:
        measured = [demo[name] for name in names if name in demo]
        return max(measured, key=lambda value: value[0]) if measured else (float("nan"), 0.0)

    lambda0 = best([f"lambda0_{source}_forward" for source in SOURCES])
    sft = best([f"sft_{source}" for source in SOURCES])
    lambda1 = best(["lambda1_forward"])
    print(
        f"lambda_study equal_time lambda1={lambda1[0]:.3f}+-{lambda1[1]:.3f} "
        f"lambda0={lambda0[0]:.3f}+-{lambda0[1]:.3f} sft={sft[0]:.3f}+-{sft[1]:.3f}"
    )


def print_scenario(scenario: str, results: list[dict], args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Prints one scenario's rows; returns each row's equal-time test accuracy (mean, std)."""
    print(f"\nscenario {scenario}")
    header = (
        f"{'setting':<34} {'seeds':>5} {'acc @ steps':>13} {'acc @ time':>13} {'steps @ time':>12} "
        f"{'KL fwd @ time':>15}"
    )
    print(header)
    print("-" * len(header))
    rows: dict[str, list[dict]] = {}
    for result in results:
        rows.setdefault(result["setting"], []).append(result)
    equal_time: dict[str, tuple[float, float]] = {}
    for name, group in rows.items():
        by_steps = [point for point in (at_steps(result, args.steps) for result in group) if point]
        by_time = [point for point in (at_time(result, args.time_budget_s) for result in group) if point]
        cells = []
        for points in (by_steps, by_time):
            mean, std = spread([p["accuracy"] for p in points]) if points else (float("nan"), 0.0)
            short = "" if len(points) == len(group) else "*"  # some seeds did not reach the budget
            cells.append(f"{mean:.3f}±{std:.3f}{short}")
        if by_time:
            equal_time[name] = spread([p["accuracy"] for p in by_time])
        kls = [p["kl_forward"] for p in by_time if p["kl_forward"] is not None]
        kl = f"{spread(kls)[0]:.4f}±{spread(kls)[1]:.4f}" if kls else "-"
        steps = f"{statistics.mean(p['step'] for p in by_time):.0f}" if by_time else "-"
        print(f"{name:<34} {len(group):>5} {cells[0]:>13} {cells[1]:>13} {steps:>12} {kl:>15}")
    return equal_time


if __name__ == "__main__":
    main()
