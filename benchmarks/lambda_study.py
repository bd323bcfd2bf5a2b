"""What on-policy data buys: λ × fixed-data source × KL direction, against SFT, across seeds (issue 23).

Every run distils the demo student (``examples/demo/models/student``) from the demo teacher
with ``examples/configs/demo.yaml`` and a few changes. The fixed data of a λ < 1 step come
from one of three sources, none of which is the teacher's own trace format by construction
except the first:

* ``teacher_samples``: the teacher's own answers, made with ``opd generate`` (greedy,
  verified; the time it took is measured and charged per answer a run trains on);
* ``reference``: the same problems' reference solutions in another valid trace format
  (``examples/data/make_arithmetic_task.py --trace reference``);
* ``answer_only``: no trace, only the answer tags (``--trace answer_only``).

Settings (each for every seed): λ = 1 (the fixed data are never used) and λ ∈ {0, 0.5} with
each source, each with forward and reverse KL; SFT on the teacher samples and SFT on the
reference solutions; and λ = 1 forward with the on-policy samples drawn greedily (the demo's
default), at temperature 0.1 (the specification's) and at temperature 1. Each setting runs
at **equal steps** (``--steps``) and at **equal wall-clock** (``--time-budget-s`` of
training time, generation and teacher time included; the temperature rows at equal steps
only, to fit the budget).

The study is resumable: each run's result is written to ``<out>/runs/<name>.json`` when it
finishes, and a rerun skips the runs that have one (``--only`` selects runs by substring).
The table gives, per setting and budget, the mean ± standard deviation over the seeds of
the test accuracy (greedy, the 256 held-out problems) and of the forward and reverse KL to
the teacher on the student's greedy test answers (the same measurement for SFT). The
last line is machine-readable, for the best fixed-data source at equal wall-clock:

    lambda_study equal_time lambda1=<mean>+-<std> lambda0=<mean>+-<std> sft=<mean>+-<std>

Usage: ``python benchmarks/lambda_study.py [--steps 150] [--time-budget-s 120] [--seeds 0 1 2]
[--jobs 2] [--only TEXT] [--out DIR]``
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


@dataclass
class Sources:
    """The fixed-data files, and the teacher's generation time per answer (charged at equal time)."""

    paths: dict[str, Path] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    seconds_per_answer: dict[str, float] = field(default_factory=dict)


def settings() -> list[Setting]:
    """The grid (see the module docstring)."""
    grid = [Setting(f"lambda1_{kl}", "distill", ("distillation.lambda=1.0", f"loss_fn.kl_type={kl}"), None)
            for kl in KL_TYPES]
    for lam in (0.0, 0.5):
        for source in SOURCES:
            for kl in KL_TYPES:
                overrides = (f"distillation.lambda={lam}", f"loss_fn.kl_type={kl}")
                grid.append(Setting(f"lambda{lam:g}_{source}_{kl}", "distill", overrides, source))
    grid += [Setting(f"sft_{source}", "sft", (), source) for source in ("teacher_samples", "reference")]
    grid += [Setting(f"lambda1_forward_{name}", "distill", ("distillation.lambda=1.0", "loss_fn.kl_type=forward",
                                                            *overrides), None, ("steps",))
             for name, overrides in TEMPERATURES.items() if overrides]
    return grid


def prepare_sources(out: Path, prompts: int) -> Sources:
    """Writes (once) the three fixed-data sources for the first ``prompts`` training problems."""
    sources = Sources()
    for trace in ("reference", "answer_only"):
        directory = out / "data" / trace
        if not (directory / "train.jsonl").is_file():
            subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py"),
                            "--trace", trace, "--out-dir", str(directory)], check=True, capture_output=True)
        sources.paths[trace], sources.formats[trace] = directory / "train.jsonl", "math_cl"
        sources.seconds_per_answer[trace] = 0.0  # a dataset's own solutions cost nothing to make
    answers, meta = out / "data" / "teacher_samples.jsonl", out / "data" / "teacher_samples.json"
    if not meta.is_file() or json.loads(meta.read_text(encoding="utf-8"))["prompts"] != prompts:
        answers.unlink(missing_ok=True)
        start = time.perf_counter()
        run_opd(["generate", "--config", str(REPO / "examples" / "configs" / "generate_demo.yaml"),
                 f"data.max_train_examples={prompts}", f"generate.output_path={answers}",
                 "generate.generate_strategy.decoding_method=greedy", "generate.max_attempts_per_prompt=null",
                 "generate.progress_bar=false", "generate.batch_size=64"], out / "logs" / "generate.log")
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


def run_one(setting: Setting, budget: str, seed: int, args: argparse.Namespace, sources: Sources,
            time_budget: float) -> dict:
    """One run, its test metrics and its charged time; the result is what ``runs/<name>.json`` holds."""
    name = f"{budget}/{setting.name}/seed{seed}"
    output_dir = args.out / name
    per_answer = sources.seconds_per_answer.get(setting.source or "", 0.0)
    batch = 32  # demo.yaml's training.batch_size
    if setting.kind == "distill":
        limit = budget_overrides(args.steps, None) if budget == "steps" else budget_overrides(None, time_budget)
        run_opd(["train", "--config", str(CONFIG), *common_overrides(output_dir), *setting.overrides,
                 *data_overrides(setting, sources), *limit, f"training.seed={seed}"],
                args.out / "logs" / f"{name.replace('/', '_')}.log")
        result = summarise_run(output_dir)
    else:
        steps = args.steps
        if budget == "time":  # SFT pays for the answers it trains on: a step costs one update plus a batch of them
            probe = json.loads((args.out / "runs" / f"steps_{setting.name}_seed{seed}.json").read_text())
            steps = max(int(time_budget // (probe["train_seconds"] / probe["steps"] + batch * per_answer)), 1)
        run_opd(["sft", "--config", str(SFT_CONFIG), *common_overrides(output_dir), f"training.max_num_steps={steps}",
                 "model.model_path=examples/demo/models/student", *data_overrides(setting, sources),
                 f"training.batch_size={batch}", "training.learning_rate=2.0e-3", "training.warmup_steps=10",
                 "training.num_epochs=1000", f"training.seed={seed}",
                 # Its data may be chat rows while the validation file is math-cl: the test eval below scores it.
                 "data.val_path=null", "validation.val_at_end=false"],
                args.out / "logs" / f"{name.replace('/', '_')}.log")
        records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
        steps_done = [record for record in records if "train/loss" in record]
        result = {"steps": len(steps_done), "train_seconds": sum(r.get("timing/step", 0.0) for r in steps_done)}
    metrics = test_metrics(CONFIG, output_dir / "final_model", output_dir, [])
    fixed_steps = result["steps"] if setting.kind == "sft" else None
    result["charged_seconds"] = result["train_seconds"] + _answer_seconds(setting, result, per_answer, batch,
                                                                           fixed_steps)
    result.update(setting=setting.name, budget=budget, seed=seed, test_accuracy=metrics["val/accuracy"])
    # The KL to the teacher on the test split, the same measurement for every method (SFT included).
    result["test_kl_forward"], result["test_kl_reverse"] = metrics["val/kl_forward"], metrics["val/kl_reverse"]
    return result


def _answer_seconds(setting: Setting, result: dict, per_answer: float, batch: int, sft_steps: int | None) -> float:
    """The teacher-sample generation time a run consumed (fixed-data steps of λ < 1 runs, every SFT step)."""
    if per_answer == 0.0:
        return 0.0
    if sft_steps is not None:
        return sft_steps * batch * per_answer
    lam = next(float(o.split("=")[1]) for o in setting.overrides if o.startswith("distillation.lambda="))
    return (1.0 - lam) * result["steps"] * batch * per_answer  # expected fixed-data steps


def spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--time-budget-s", type=float, default=120.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default=None, help="run only the runs whose name contains this text")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "lambda_study")
    args = parser.parse_args()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    if not (TASK / "test.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py")], check=True)
    start = time.perf_counter()
    sources = prepare_sources(args.out, args.steps * 32)

    def job(setting: Setting, budget: str, seed: int) -> dict:
        path = args.out / "runs" / f"{budget}_{setting.name}_seed{seed}.json"
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        result = run_one(setting, budget, seed, args, sources, args.time_budget_s)
        path.write_text(json.dumps(result, indent=2), encoding="utf-8")
        print(f"  done {budget}/{setting.name}/seed{seed}: test accuracy {result['test_accuracy']:.3f} "
              f"after {result['steps']} steps", flush=True)
        return result

    wanted = [(setting, budget, seed) for setting in settings() for budget in setting.budgets for seed in args.seeds
              if args.only is None or args.only in f"{budget}/{setting.name}/seed{seed}"]
    # SFT's equal-time runs read their equal-steps run's step time: run every equal-steps run first.
    results: list[dict] = []
    for phase in ("steps", "time"):
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results += list(pool.map(lambda item: job(*item), [item for item in wanted if item[1] == phase]))
    print_table(results, args, time.perf_counter() - start)


def print_table(results: list[dict], args: argparse.Namespace, seconds: float) -> None:
    print()
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.jobs} runs at "
          f"a time (1 thread each); seeds {args.seeds}; this invocation {seconds / 60:.1f} min")
    print(f"equal steps = {args.steps}; equal wall-clock = {args.time_budget_s:g} s of training, teacher-sample "
          "generation charged per answer used")
    header = f"{'setting':<36} {'budget':<6} {'steps':>6} {'test acc':>15} {'test KL fwd':>15} {'test KL rev':>15}"
    print(header)
    print("-" * len(header))
    rows: dict[tuple[str, str], list[dict]] = {}
    for result in results:
        rows.setdefault((result["setting"], result["budget"]), []).append(result)
    summary: dict[tuple[str, str], tuple[float, float]] = {}
    for (name, budget), group in rows.items():
        accuracy = spread([r["test_accuracy"] for r in group])
        summary[(name, budget)] = accuracy
        kls = []
        for key in ("test_kl_forward", "test_kl_reverse"):
            values = [r[key] for r in group if r[key] == r[key]]
            kls.append(f"{spread(values)[0]:.4f}±{spread(values)[1]:.4f}" if values else "-")
        steps = statistics.mean(r["steps"] for r in group)
        print(f"{name:<36} {budget:<6} {steps:>6.0f} {accuracy[0]:>7.3f}±{accuracy[1]:<6.3f} {kls[0]:>15} {kls[1]:>15}")
    best = max(SOURCES, key=lambda s: max(summary.get((f"lambda0_{s}_{kl}", "time"), (-1.0, 0.0))[0]
                                          for kl in KL_TYPES))
    lambda1 = max((summary.get((f"lambda1_{kl}", "time"), (float("nan"), 0.0)) for kl in KL_TYPES),
                  key=lambda v: v[0] if v[0] == v[0] else -1.0)
    lambda0 = max((summary.get((f"lambda0_{best}_{kl}", "time"), (float("nan"), 0.0)) for kl in KL_TYPES),
                  key=lambda v: v[0] if v[0] == v[0] else -1.0)
    sft = summary.get((f"sft_{best}", "time"), summary.get(("sft_teacher_samples", "time"), (float("nan"), 0.0)))
    print(f"lambda_study equal_time lambda1={lambda1[0]:.3f}+-{lambda1[1]:.3f} "
          f"lambda0={lambda0[0]:.3f}+-{lambda0[1]:.3f} sft={sft[0]:.3f}+-{sft[1]:.3f}")


if __name__ == "__main__":
    main()
