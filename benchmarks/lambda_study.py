"""What on-policy data buys: λ × fixed-data source × KL direction, against SFT, across seeds (issue 23).

Every run distils a student from a teacher with ``examples/configs/demo.yaml`` and a few
changes. Four scenarios (``--scenarios``):

* ``demo``: the README demo's pair (``examples/demo/models/{teacher,student}``) on 3-digit
  addition; it runs the full grid below;
* ``student_small`` and ``student_tiny``: a capacity gap, one-layer students of hidden size
  64 and 32 against the demo teacher;
* ``5digit``: a harder task, 5-digit addition, with a teacher fine-tuned on it and the demo
  student fine-tuned briefly to write its trace format.

The extra models come from ``examples/demo/prepare_study_models.py`` (committed). The fixed
data of a λ < 1 step come from one of three sources, written for each scenario's task:

* ``teacher_samples``: the teacher's own answers, made with ``opd generate`` (greedy,
  verified; the time it took is measured and charged per answer a run trains on);
* ``reference``: the same problems' reference solutions in another valid trace format
  (``examples/data/make_arithmetic_task.py --trace reference``);
* ``answer_only``: no trace, only the answer tags (``--trace answer_only``).

The demo's grid: λ = 1 (the fixed data are never used) and λ ∈ {0, 0.5} with each source,
each with forward and reverse KL; SFT on the teacher samples and SFT on the reference
solutions; and λ = 1 forward with the on-policy samples drawn greedily (the demo's
default), at temperature 0.1 (the specification's) and at temperature 1. Each setting runs
at **equal steps** (``--steps``) and at **equal wall-clock** (``--time-budget-s`` of
training time, generation and teacher time included), except the reverse-KL rows (equal
wall-clock only) and the temperature rows (equal steps only). The other scenarios run a
sample of the grid: λ ∈ {1, 0.5, 0} with the teacher's samples, forward KL, at equal
wall-clock, and SFT on the teacher's samples. With three seeds that is 126 runs, about two
hours on 2 cores at the default budgets.

The study is resumable: each run's result is written to ``<out>/runs/<name>.json`` when it
finishes (``benchmarks/results/lambda_study/runs/`` by default, kept in the repository),
and a rerun at the same ``--steps`` / ``--time-budget-s`` skips the runs that have one
(``--only`` selects runs by substrings of their names). The tables give, per scenario,
setting and budget, the mean ± standard deviation over the seeds of the test accuracy
(greedy, the 256 held-out problems) and of the forward and reverse KL to the teacher on
the student's greedy test answers (the same measurement for SFT). The last line is
machine-readable, for the demo's pair and the best fixed-data source at equal wall-clock:

    lambda_study equal_time lambda1=<mean>+-<std> lambda0=<mean>+-<std> sft=<mean>+-<std>

Usage: ``python benchmarks/lambda_study.py [--steps 100] [--time-budget-s 90] [--seeds 0 1 2]
[--jobs 2] [--scenarios demo ...] [--only TEXT ...] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_lambda_kl import (  # noqa: E402  (the sweep's run helpers, shared)
    CONFIG,
    SFT_CONFIG,
    TASK,
    budget_overrides,
    common_overrides,
    run_opd,
    summarise_run,
    test_metrics,
)

SOURCES = ("teacher_samples", "reference", "answer_only")
KL_TYPES = ("forward", "reverse")
TEMPERATURES = {"greedy": [], "temp0.1": ["distillation.generate_strategy.decoding_method=top_p",
                                          "distillation.generate_strategy.temperature=0.1"],
                "temp1": ["distillation.generate_strategy.decoding_method=top_p",
                          "distillation.generate_strategy.temperature=1.0"]}
MODELS = REPO / "examples" / "demo" / "models"
BATCH = 32  # demo.yaml's training.batch_size, also the SFT baselines'


@dataclass(frozen=True)
class Setting:
    """One row of the table: a method and its overrides (the budget and seed are added per run).

    Attributes:
        name: the row's name, e.g. ``lambda0.5_reference_forward``.
        kind: ``distill`` (``opd train``) or ``sft`` (``opd sft``).
        overrides: config overrides of the method.
        source: the fixed data it reads (None: on-policy only).
        budgets: the budgets it runs at.
    """

    name: str
    kind: str
    overrides: tuple[str, ...]
    source: str | None
    budgets: tuple[str, ...] = ("steps", "time")


@dataclass(frozen=True)
class Scenario:
    """A teacher, a student and a task; the demo's pair runs the full grid, the others a sample of it.

    Attributes:
        name: the scenario's name (``demo``, ``student_small``, ``student_tiny``, ``5digit``).
        teacher: the teacher's model directory.
        student: the student's model directory.
        task: the directory with the task's train/val/test.jsonl (the teacher's trace format).
        digits: the operands' digits (the other sources are written with the same).
        max_length: the generation limit of rollouts, validation and test.
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
        """The config overrides that put this scenario's models, task and lengths into demo.yaml."""
        if self.name == "demo":
            return []  # demo.yaml as it is
        return [f"model.teacher_model_path={self.teacher}", f"model.student_model_path={self.student}",
                f"data.train_path={self.task / 'train.jsonl'}", f"data.val_path={self.task / 'val.jsonl'}",
                f"distillation.generate_strategy.max_length={self.max_length}",
                f"validation.generate_strategy.max_length={self.max_length}"]


SCENARIOS = {
    scenario.name: scenario for scenario in (
        Scenario("demo", MODELS / "teacher", MODELS / "student", TASK, 3, 96, sampled=False),
        # Capacity gap: one-layer students, hidden 64 and 32, against the demo teacher.
        Scenario("student_small", MODELS / "teacher", MODELS / "study_student_small", TASK, 3, 96, sampled=True),
        Scenario("student_tiny", MODELS / "teacher", MODELS / "study_student_tiny", TASK, 3, 96, sampled=True),
        # Harder task: 5-digit addition.
        Scenario("5digit", MODELS / "study_teacher_5digit", MODELS / "study_student_5digit",
                 REPO / "examples" / "data" / "arithmetic_5digit", 5, 128, sampled=True),
    )
}


@dataclass
class Sources:
    """One scenario's fixed-data files, and the teacher's generation time per answer (charged at equal time)."""

    paths: dict[str, Path] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    seconds_per_answer: dict[str, float] = field(default_factory=dict)


def settings(scenario: Scenario) -> list[Setting]:
    """The grid of a scenario.

    The demo's pair runs all of it (see the module docstring). The sampled grid of the other
    scenarios keeps what the headline compares, at equal wall-clock only: λ = 1, λ = 0.5
    and λ = 0 on the teacher's own samples (the specification's fixed data), forward KL,
    and SFT on the teacher's samples (whose equal-steps run also measures its step time).
    """
    if scenario.sampled:
        return [Setting("lambda1_forward", "distill", ("distillation.lambda=1.0", "loss_fn.kl_type=forward"), None,
                        ("time",)),
                *(Setting(f"lambda{lam:g}_teacher_samples_forward", "distill",
                          (f"distillation.lambda={lam}", "loss_fn.kl_type=forward"), "teacher_samples", ("time",))
                  for lam in (0.0, 0.5)),
                Setting("sft_teacher_samples", "sft", (), "teacher_samples")]
    # Reverse KL at equal wall-clock only: the earlier sweep (guide section 8) found it far
    # behind forward KL at both budgets, so its equal-steps rows buy the least.
    budgets = {"forward": ("steps", "time"), "reverse": ("time",)}
    grid = [Setting(f"lambda1_{kl}", "distill", ("distillation.lambda=1.0", f"loss_fn.kl_type={kl}"), None,
                    budgets[kl]) for kl in KL_TYPES]
    for lam in (0.0, 0.5):
        for source in SOURCES:
            for kl in KL_TYPES:
                overrides = (f"distillation.lambda={lam}", f"loss_fn.kl_type={kl}")
                grid.append(Setting(f"lambda{lam:g}_{source}_{kl}", "distill", overrides, source, budgets[kl]))
    grid += [Setting(f"sft_{source}", "sft", (), source) for source in ("teacher_samples", "reference")]
    grid += [Setting(f"lambda1_forward_{name}", "distill", ("distillation.lambda=1.0", "loss_fn.kl_type=forward",
                                                            *overrides), None, ("steps",))
             for name, overrides in TEMPERATURES.items() if overrides]
    return grid


def prepare_sources(out: Path, scenario: Scenario, prompts: int) -> Sources:
    """Writes (once) the scenario's three fixed-data sources for its first ``prompts`` training problems."""
    sources = Sources()
    data = out / "data" / scenario.name
    for trace in ("reference", "answer_only"):
        directory = data / trace
        if not (directory / "train.jsonl").is_file():
            subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py"),
                            "--trace", trace, "--digits", str(scenario.digits), "--out-dir", str(directory)],
                           check=True, capture_output=True)
        sources.paths[trace], sources.formats[trace] = directory / "train.jsonl", "math_cl"
        sources.seconds_per_answer[trace] = 0.0  # a dataset's own solutions cost nothing to make
    answers, meta = data / "teacher_samples.jsonl", data / "teacher_samples.json"
    if not meta.is_file() or json.loads(meta.read_text(encoding="utf-8"))["prompts"] != prompts:
        answers.unlink(missing_ok=True)
        start = time.perf_counter()
        run_opd(["generate", "--config", str(REPO / "examples" / "configs" / "generate_demo.yaml"),
                 f"generate.model_path={scenario.teacher}", f"data.train_path={scenario.task / 'train.jsonl'}",
                 f"data.max_train_examples={prompts}", f"generate.output_path={answers}",
                 f"generate.generate_strategy.max_length={scenario.max_length}",
                 "generate.generate_strategy.decoding_method=greedy", "generate.max_attempts_per_prompt=null",
                 "generate.progress_bar=false", "generate.batch_size=64"],
                out / "logs" / f"generate_{scenario.name}.log")
        seconds = time.perf_counter() - start
        rows = len(answers.read_text(encoding="utf-8").splitlines())
        meta.write_text(json.dumps({"prompts": prompts, "rows": rows, "seconds": seconds}), encoding="utf-8")
    recorded = json.loads(meta.read_text(encoding="utf-8"))
    sources.paths["teacher_samples"], sources.formats["teacher_samples"] = answers, "chat"
    sources.seconds_per_answer["teacher_samples"] = recorded["seconds"] / max(recorded["rows"], 1)
    return sources


def data_overrides(setting: Setting, sources: Sources) -> list[str]:
    if setting.source is None:
        return []
    return [f"data.train_path={sources.paths[setting.source]}", f"data.data_format={sources.formats[setting.source]}"]


def run_name(scenario: Scenario, budget: str, setting: Setting, seed: int) -> str:
    """``<scenario>/<budget>/<setting>/seed<N>`` (the demo's runs keep the first study's names)."""
    prefix = "" if scenario.name == "demo" else f"{scenario.name}/"
    return f"{prefix}{budget}/{setting.name}/seed{seed}"


def run_one(scenario: Scenario, setting: Setting, budget: str, seed: int, args: argparse.Namespace,
            sources: Sources) -> dict:
    """One run, its test metrics and its charged time; the result is what ``runs/<name>.json`` holds."""
    name = run_name(scenario, budget, setting, seed)
    output_dir = args.out / name
    log = args.out / "logs" / f"{name.replace('/', '_')}.log"
    per_answer = sources.seconds_per_answer.get(setting.source or "", 0.0)
    if setting.kind == "distill":
        limit = budget_overrides(args.steps, None) if budget == "steps" else budget_overrides(None, args.time_budget_s)
        run_opd(["train", "--config", str(CONFIG), *common_overrides(output_dir), *scenario.overrides(),
                 *setting.overrides, *data_overrides(setting, sources), *limit, f"training.seed={seed}"], log)
        result = summarise_run(output_dir)
    else:
        steps = args.steps
        if budget == "time":  # SFT pays for the answers it trains on: a step costs one update plus a batch of them
            probe_name = run_name(scenario, "steps", setting, seed).replace("/", "_")
            probe = json.loads((args.out / "runs" / f"{probe_name}.json").read_text())
            steps = max(int(args.time_budget_s // (probe["train_seconds"] / probe["steps"] + BATCH * per_answer)), 1)
        run_opd(["sft", "--config", str(SFT_CONFIG), *common_overrides(output_dir), f"training.max_num_steps={steps}",
                 f"model.model_path={scenario.student}", *data_overrides(setting, sources),
                 f"training.batch_size={BATCH}", "training.learning_rate=2.0e-3", "training.warmup_steps=10",
                 "training.num_epochs=1000", f"training.seed={seed}",
                 # Its data may be chat rows while the validation file is math-cl: the test eval below scores it.
                 "data.val_path=null", "validation.val_at_end=false"], log)
        records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
        steps_done = [record for record in records if "train/loss" in record]
        result = {"steps": len(steps_done), "train_seconds": sum(r.get("timing/step", 0.0) for r in steps_done)}
    metrics = test_metrics(CONFIG, output_dir / "final_model", output_dir, scenario.overrides(), scenario.task)
    fixed_steps = result["steps"] if setting.kind == "sft" else None
    result["charged_seconds"] = result["train_seconds"] + _answer_seconds(setting, result, per_answer, fixed_steps)
    result.update(scenario=scenario.name, setting=setting.name, budget=budget, seed=seed,
                  test_accuracy=metrics["val/accuracy"], machine=f"{platform.machine()} x{os.cpu_count()}")
    # The KL to the teacher on the test split, the same measurement for every method (SFT included).
    result["test_kl_forward"], result["test_kl_reverse"] = metrics["val/kl_forward"], metrics["val/kl_reverse"]
    return result


def _answer_seconds(setting: Setting, result: dict, per_answer: float, sft_steps: int | None) -> float:
    """The teacher-sample generation time a run consumed (fixed-data steps of λ < 1 runs, every SFT step)."""
    if per_answer == 0.0:
        return 0.0
    if sft_steps is not None:
        return sft_steps * BATCH * per_answer
    lam = next(float(o.split("=")[1]) for o in setting.overrides if o.startswith("distillation.lambda="))
    return (1.0 - lam) * result["steps"] * BATCH * per_answer  # expected fixed-data steps


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--time-budget-s", type=float, default=90.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only the runs whose name contains one of these texts")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lambda_study")
    args = parser.parse_args()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    scenarios = [SCENARIOS[name] for name in args.scenarios]
    for scenario in scenarios:
        missing = [str(path) for path in (scenario.teacher, scenario.student) if not (path / "config.json").is_file()]
        if missing:
            raise SystemExit(f"scenario {scenario.name}: no model at {', '.join(missing)}; "
                             "run python examples/demo/prepare_study_models.py")
        if not (scenario.task / "test.jsonl").is_file():
            subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py"),
                            "--digits", str(scenario.digits), "--out-dir", str(scenario.task)], check=True)
    wanted = [(scenario, setting, budget, seed) for scenario in scenarios for setting in settings(scenario)
              for budget in setting.budgets for seed in args.seeds
              if args.only is None or any(text in run_name(scenario, budget, setting, seed) for text in args.only)]
    # Teacher samples only for the scenarios that will read them (generating them is the slow part).
    sources = {scenario.name: prepare_sources(args.out, scenario, args.steps * BATCH)
               for scenario in {item[0] for item in wanted}}

    def job(scenario: Scenario, setting: Setting, budget: str, seed: int) -> dict:
        name = run_name(scenario, budget, setting, seed)
        path = args.out / "runs" / f"{name.replace('/', '_')}.json"
        budget_value = args.steps if budget == "steps" else args.time_budget_s
        if path.is_file():  # reused only if it ran at this invocation's budget
            recorded = json.loads(path.read_text(encoding="utf-8"))
            if recorded.get("budget_value") == budget_value:
                return recorded
        result = run_one(scenario, setting, budget, seed, args, sources[scenario.name])
        result["budget_value"] = budget_value
        path.write_text(json.dumps(result, indent=2), encoding="utf-8")
        print(f"  done {name}: test accuracy {result['test_accuracy']:.3f} after {result['steps']} steps", flush=True)
        return result

    # SFT's equal-time runs read their equal-steps run's step time: run every equal-steps run first.
    results: list[dict] = []
    for phase in ("steps", "time"):
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results += list(pool.map(lambda item: job(*item), [item for item in wanted if item[2] == phase]))
    print_table(results, args, time.perf_counter() - start)


def print_table(results: list[dict], args: argparse.Namespace, seconds: float) -> None:
    """One table per scenario (mean ± std over the seeds), then the headline line of the demo's pair."""
    print()
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.jobs} runs at "
          f"a time (1 thread each); seeds {args.seeds}; this invocation {seconds / 60:.1f} min")
    print(f"equal steps = {args.steps}; equal wall-clock = {args.time_budget_s:g} s of training, teacher-sample "
          "generation charged per answer used")
    summaries: dict[str, dict[tuple[str, str], tuple[float, float]]] = {}
    for scenario in args.scenarios:
        group_results = [r for r in results if r.get("scenario", "demo") == scenario]
        if group_results:
            summaries[scenario] = print_scenario(scenario, group_results)
    summary = summaries.get("demo", {})
    best = max(SOURCES, key=lambda s: max(summary.get((f"lambda0_{s}_{kl}", "time"), (-1.0, 0.0))[0]
                                          for kl in KL_TYPES))
    lambda1 = best_of(summary.get((f"lambda1_{kl}", "time")) for kl in KL_TYPES)
    lambda0 = best_of(summary.get((f"lambda0_{best}_{kl}", "time")) for kl in KL_TYPES)
    sft = summary.get((f"sft_{best}", "time"), summary.get(("sft_teacher_samples", "time"), (float("nan"), 0.0)))
    print(f"lambda_study equal_time lambda1={lambda1[0]:.3f}+-{lambda1[1]:.3f} "
          f"lambda0={lambda0[0]:.3f}+-{lambda0[1]:.3f} sft={sft[0]:.3f}+-{sft[1]:.3f}")


def best_of(candidates: Iterable[tuple[float, float] | None]) -> tuple[float, float]:
    """The (mean, std) with the highest mean among those measured; (nan, 0) if none was."""
    measured = [candidate for candidate in candidates if candidate is not None]
    return max(measured, key=lambda value: value[0]) if measured else (float("nan"), 0.0)


def print_scenario(scenario: str, results: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
    """Prints one scenario's rows; returns each row's test accuracy (mean, std) by (setting, budget)."""
    print(f"\nscenario {scenario}")
    header = (f"{'setting':<36} {'budget':<6} {'seeds':>5} {'steps':>6} {'test acc':>15} {'test KL fwd':>15} "
              f"{'test KL rev':>15}")
    print(header)
    print("-" * len(header))
    rows: dict[tuple[str, str], list[dict]] = {}
    for result in results:
        rows.setdefault((result["setting"], result["budget"]), []).append(result)
    summary: dict[tuple[str, str], tuple[float, float]] = {}
    for (name, budget), group in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
        accuracy = spread([r["test_accuracy"] for r in group])
        summary[(name, budget)] = accuracy
        kls = []
        for key in ("test_kl_forward", "test_kl_reverse"):
            values = [r[key] for r in group if r[key] == r[key]]
            kls.append(f"{spread(values)[0]:.4f}±{spread(values)[1]:.4f}" if values else "-")
        steps = statistics.mean(r["steps"] for r in group)
        print(f"{name:<36} {budget:<6} {len(group):>5} {steps:>6.0f} {accuracy[0]:>7.3f}±{accuracy[1]:<6.3f} "
              f"{kls[0]:>15} {kls[1]:>15}")
    return summary


if __name__ == "__main__":
    main()
