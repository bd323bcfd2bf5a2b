"""Which off-policy correction an asynchronous schedule should use by default (issue 37, point 2).

One-step-off and two-step-off train on rollouts sampled with weights one or two updates
old, and ``training.off_policy_correction`` weighs each position of a stale sample by a
truncated importance ratio (guide, "The off-policy correction"). This study measures what
that weight does to learning, cell by cell of a full grid:

* loss: ``full_vocab`` (the exact forward KL) or ``topk`` (k = 16);
* schedule: ``one_step_off`` (staleness 1) or ``two_step_off`` (staleness 2);
* correction: ``off``, ``token`` (each position min(ρ_t, 2), the default) or ``sequence``
  (every position of a sequence min(ρ̄, 2), ρ̄ its geometric-mean ratio);
* rollouts: ``greedy`` or ``temp0.1`` (top-p 0.95 at temperature 0.1, the specification's).

Every run is an ``opd train`` of ``examples/configs/demo.yaml`` in one process, one
thread, λ = 1, forward KL, with a constant learning rate after 10 warm-up steps (as in
the λ study). In one process an asynchronous schedule runs its phases one after another
and draws exactly the samples a cluster run draws (``opd.distillation.step``),
so the learning dynamics are those of the overlapped run; only the overlap's speed is
missing, and it does not differ between the corrections of one cell. Each run trains for
``--run-seconds`` of training time (validation excluded), so the cells are compared at
equal wall-clock, then evaluates the test split once (greedy accuracy, and the KL to the
teacher on the student's own answers). The importance-ratio metrics the correction logs
(``train/is_ratio_mean``, ``train/is_abs_log_ratio_mean``, ``train/is_truncated_fraction``)
and ``train/is_outside_support_fraction`` (ρ = 0: the sampled token lies outside the
learner's top-p set) are averaged over the run's steps; a run without the correction logs
none.

Scenarios (``--scenarios``), from the λ study (``benchmarks/lambda_study.py``): ``demo``
(the README demo's pair, 3-digit addition) and ``5digit`` (5-digit addition, its own
teacher and student, ``examples/demo/prepare_study_models.py``).

The study is resumable: each run's result goes to ``<out>/runs/<name>.json`` and a rerun
with the same ``--run-seconds`` reuses it. ``--deadline-s`` stops starting runs that
could not end in time (for a machine lent for a fixed time); ``--jobs`` runs go at a
time, seed by seed, so a study cut short has whole seeds. The tables give mean ± sample
standard deviation over the seeds per cell, then the correction's effect averaged over
the other factors. The last line is machine-readable:

    off_policy_study <scenario> <loss> off=<mean> token=<mean> sequence=<mean> ...

Usage: ``python benchmarks/off_policy_study.py [--scenarios demo 5digit] [--seeds 0 1 2]
[--run-seconds 120] [--jobs 2] [--deadline-s S] [--only TEXT ...] [--eval-examples N]
[--out DIR] [--smoke]`` (``--smoke``: one cell, one seed, 3 s, 8 test problems, in a
temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    SMOKE_TRAIN_EXAMPLES,
    add_train_examples_argument,
    arithmetic_task,
    parse_arguments,
    train_examples_overrides,
)
from lambda_study import SCENARIOS, Scenario, spread  # noqa: E402
from sweep_lambda_kl import CONFIG, NO_STEP_CAP, run_opd  # noqa: E402

LOSSES = {
    "full_vocab": ("loss_fn.type=full_vocab", "loss_fn.compile_kernels=false"),
    "topk": ("loss_fn.type=topk", "loss_fn.k=16"),
}
SCHEDULES = ("one_step_off", "two_step_off")
CORRECTIONS = {
    "off": ("training.off_policy_correction.enabled=false",),
    "token": ("training.off_policy_correction.enabled=true", "training.off_policy_correction.level=token"),
    "sequence": ("training.off_policy_correction.enabled=true", "training.off_policy_correction.level=sequence"),
}
ROLLOUTS = {
    "greedy": ("distillation.generate_strategy.decoding_method=greedy",),
    "temp0.1": (
        "distillation.generate_strategy.decoding_method=top_p",
        "distillation.generate_strategy.temperature=0.1",
        "distillation.generate_strategy.top_p=0.95",
    ),
}
RATIO_METRICS = (
    "is_ratio_mean",
    "is_abs_log_ratio_mean",
    "is_truncated_fraction",
    "is_outside_support_fraction",
    "is_ratio_max",
)


@dataclass(frozen=True)
class Cell:
    """One combination of the four factors."""

    loss: str
    schedule: str
    correction: str
    rollouts: str

    @property
    def name(self) -> str:
        return f"{self.loss}_{self.schedule}_{self.correction}_{self.rollouts}"

    def overrides(self) -> list[str]:
        return [
            *LOSSES[self.loss],
            f"training.scheduler={self.schedule}",
            *CORRECTIONS[self.correction],
            *ROLLOUTS[self.rollouts],
        ]


CELLS = [Cell(*combination) for combination in itertools.product(LOSSES, SCHEDULES, CORRECTIONS, ROLLOUTS)]


def run_one(scenario: Scenario, cell: Cell, seed: int, args: argparse.Namespace) -> dict:
    """One run: ``--run-seconds`` of training, then one evaluation of the test split."""
    name = f"{scenario.name}_{cell.name}_seed{seed}"
    output_dir = args.out / "outputs" / name
    shutil.rmtree(output_dir, ignore_errors=True)  # a run without its result file is redone from the start
    run_opd(
        [
            "train",
            "--config",
            str(CONFIG),
            f"output_dir={output_dir}",
            "logger.console=false",
            "logger.progress_bar=false",
            "checkpointing.enabled=false",
            "training.lr_scheduler=constant_with_warmup",
            "training.warmup_steps=10",
            "training.val_freq=0",
            "validation.val_at_start=false",
            "validation.val_at_end=true",
            f"training.max_train_time_s={args.run_seconds}",
            f"training.max_num_steps={NO_STEP_CAP}",
            f"training.seed={seed}",
            "distillation.lambda=1.0",
            f"data.train_path={scenario.task / 'train.jsonl'}",
            *train_examples_overrides(args.train_examples),
            *scenario.overrides(),
            *([] if args.eval_examples is None else [f"data.max_val_examples={args.eval_examples}"]),
            f"model.student_model_path={scenario.student}",
            f"model.teacher_model_path={scenario.teacher}",
            f"distillation.generate_strategy.max_length={scenario.max_length}",
            *cell.overrides(),
        ],
        args.out / "logs" / f"{name}.log",
    )
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    steps = [record for record in records if "timing/step" in record]
    final = [record for record in records if "val/accuracy" in record][-1]
    ratios = {
        # float(): the metrics log writes a non-finite value as a string ("inf", "nan").
        key: statistics.mean(float(record[f"train/{key}"]) for record in steps) if f"train/{key}" in steps[-1] else None
        for key in RATIO_METRICS
    }
    return {
        "scenario": scenario.name,
        "cell": cell.name,
        "seed": seed,
        "run_seconds": args.run_seconds,
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "jobs": args.jobs,
        "steps": final["step"],
        "seconds_per_step": statistics.median(record["timing/step"] for record in steps),
        "accuracy": final["val/accuracy"],
        "kl_forward": final.get("val/kl_forward"),
        "kl_reverse": final.get("val/kl_reverse"),
        "staleness_mean": statistics.mean(record.get("train/staleness_mean", 0.0) for record in steps),
        **ratios,
    }


def study(args: argparse.Namespace) -> None:
    """Runs what is missing under ``args.out`` (in time for ``--deadline-s``) and prints the tables."""
    started = time.perf_counter()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    scenarios = [SCENARIOS[name] for name in args.scenarios]
    for scenario in scenarios:
        arithmetic_task(scenario.task, scenario.digits)
    wanted = [
        (scenario, cell, seed)
        for seed in args.seeds  # seed by seed: a study cut short has whole seeds
        for scenario in scenarios
        for cell in CELLS
        if args.only is None or any(text in f"{scenario.name}_{cell.name}_seed{seed}" for text in args.only)
    ]

    def job(scenario: Scenario, cell: Cell, seed: int) -> dict | None:
        path = args.out / "runs" / f"{scenario.name}_{cell.name}_seed{seed}.json"
        if path.is_file():
            recorded = json.loads(path.read_text(encoding="utf-8"))
            if recorded["run_seconds"] == args.run_seconds:
                return recorded
        # A run takes its training time plus start-up and one evaluation (--overhead-s).
        if (
            args.deadline_s is not None
            and time.perf_counter() - started + args.run_seconds + args.overhead_s > args.deadline_s
        ):
            print(f"  skipped {path.stem}: it would end after the deadline", flush=True)
            return None
        result = run_one(scenario, cell, seed, args)
        path.write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(
            f"  done {path.stem}: accuracy {result['accuracy']:.3f} after {result['steps']} steps "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = [result for result in pool.map(lambda item: job(*item), wanted) if result is not None]
    print(
        f"\nhardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {args.jobs} runs at a "
        f"time (1 thread each); {args.run_seconds:g} s of training per run; this invocation "
        f"{(time.perf_counter() - started) / 60:.1f} min"
    )
    for scenario in args.scenarios:
        group = [result for result in results if result["scenario"] == scenario]
        if group:
            print_scenario(scenario, group)


def _mean_std(values: list[float]) -> str:
    """``mean±std`` over the seeds (the λ study's :func:`spread`), or ``-`` without values."""
    if not values:
        return "-"
    mean, std = spread(values)
    return f"{mean:.3f}±{std:.3f}"


def _mean(values: list[float | None], digits: int = 3) -> str:
    present = [value for value in values if value is not None]
    return f"{statistics.mean(present):.{digits}f}" if present else "-"


def print_scenario(scenario: str, results: list[dict]) -> None:
    """The grid's table, then the correction's effect per loss averaged over schedules and rollouts."""
    by_cell: dict[str, list[dict]] = {}
    for result in results:
        by_cell.setdefault(result["cell"], []).append(result)
    print(f"\nscenario {scenario}")
    header = (
        f"{'loss':<11}{'schedule':<14}{'rollouts':<9}{'correction':<11}{'seeds':>5} {'accuracy':>13} "
        f"{'KL rev':>13} {'steps':>6} {'s/step':>7} {'ρ mean':>7} {'|log ρ|':>8} {'cut':>6} {'ρ=0':>6} {'ρ max':>7}"
    )
    print(header)
    print("-" * len(header))
    for cell in CELLS:
        runs = by_cell.get(cell.name, [])
        if not runs:
            continue
        print(
            f"{cell.loss:<11}{cell.schedule:<14}{cell.rollouts:<9}{cell.correction:<11}{len(runs):>5} "
            f"{_mean_std([run['accuracy'] for run in runs]):>13} "
            f"{_mean_std([run['kl_reverse'] for run in runs]):>13} "
            f"{statistics.mean(run['steps'] for run in runs):>6.0f} "
            f"{statistics.mean(run['seconds_per_step'] for run in runs):>7.2f} "
            f"{_mean([run['is_ratio_mean'] for run in runs]):>7} "
            f"{_mean([run['is_abs_log_ratio_mean'] for run in runs], 4):>8} "
            f"{_mean([run['is_truncated_fraction'] for run in runs], 4):>6} "
            f"{_mean([run.get('is_outside_support_fraction') for run in runs], 4):>6} "
            f"{_mean([run['is_ratio_max'] for run in runs], 2):>7}"
        )
    print("\nthe correction's effect, per loss (each seed's accuracy averaged over schedules and rollouts first)")
    for loss in LOSSES:
        summary = []
        for correction in CORRECTIONS:
            per_seed: dict[int, list[float]] = {}
            for result in results:
                cell = next(cell for cell in CELLS if cell.name == result["cell"])
                if cell.loss == loss and cell.correction == correction:
                    per_seed.setdefault(result["seed"], []).append(result["accuracy"])
            means = [statistics.mean(values) for values in per_seed.values()]
            summary.append(f"{correction}={_mean_std(means)}")
        print(f"off_policy_study {scenario} {loss} {' '.join(summary)}")


SMOKE = {
    "scenarios": ["demo"],
    "seeds": [0],
    "only": ["full_vocab_one_step_off_sequence_greedy"],
    "run_seconds": 3.0,
    "eval_examples": 8,
    "out": None,
    "train_examples": SMOKE_TRAIN_EXAMPLES,
}
"""``--smoke``: one cell of the demo's pair (the sequence-level correction), one seed, 3 s, 8 test problems."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=["demo", "5digit"], default=["demo", "5digit"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--run-seconds", type=float, default=120.0, help="each run's training time")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="start no run that would end later than this after the start"
    )
    parser.add_argument(
        "--overhead-s", type=float, default=30.0, help="a run's start-up and evaluation, for --deadline-s"
    )
    parser.add_argument("--only", nargs="+", default=None, help="run only the runs whose name contains one of these")
    parser.add_argument("--eval-examples", type=int, default=None, help="test problems (default: the whole split)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "off_policy_study")
    add_train_examples_argument(parser)
    args = parse_arguments(parser, SMOKE)
    with contextlib.ExitStack() as stack:
        if args.out is None:  # --smoke keeps nothing
            args.out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="opd_off_policy_study_smoke_")))
        study(args)


if __name__ == "__main__":
    main()
