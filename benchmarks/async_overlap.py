"""Overlapping rollout, teacher and training on CPU: sync against one-step-off and two-step-off.

Every run is one ``opd train`` of the CPU demo (its committed tiny teacher and student,
greedy on-policy rollouts, λ = 1) in a fresh process with its own private Ray cluster,
on split pools: one trainer worker and one rollout worker (and, for the top-k runs, one
teacher worker), one thread each.

**Speed** (``--part speed``): steps/s of each schedule, medians over the steps after
``--warmup`` and over ``--repeats`` interleaved repeats (each speedup is taken within a
repeat, against that repeat's sync run; the table and the last line give their median
and range over the repeats, never the best), with the waits broken down
(``wait_prev_gen``: the step waited for its rollout; ``wait_prev_teacher``: for its
teacher score; ``sync``: the weight sync to the rollout worker; ``training``: the
trainer call) and the mean response length (``response``). Two groups, each against its
own sync:

* the exact full-vocabulary loss with the teacher colocated in the trainer worker: sync
  and one-step-off (two-step-off needs a teacher that scores apart from the trainer);
* the top-k loss with a teacher worker of its own: sync, one-step-off and two-step-off.

``--max-length`` sets the rollout length so that generation and training take about
equal time (the case the schedules are for).

Equal work per step, as in ``benchmarks/scaling.py``: a student that learns drifts, its
greedy responses get longer or shorter, and the schedules would no longer generate and
train the same number of tokens per step (an off-policy schedule also learns from older
samples, so it drifts differently from sync). So the speed runs train by default with a
learning rate of 1e-12: each step does all the work of a real step (generation, weight
sync, teacher, forward, backward, AdamW), the weights do not move, and the responses
keep the lengths they start with. ``--learn`` runs the speed part at the demo's learning
rate instead. (The learning part always learns.)

**Learning** (``--part learning``): test accuracy (``val/accuracy`` on the demo's held-out
split, greedy) at equal wall-clock (``training.max_train_time_s`` of optimizer steps) for
sync and one-step-off with and without the off-policy correction, over ``--seeds`` seeds,
as mean ± standard deviation.

The demo's task is written first if it is missing (``examples/data/make_arithmetic_task.py``).

Usage: ``python benchmarks/async_overlap.py [--part speed|learning|both] [--repeats 3]
[--learn] [--setups SETUP ...] [--no-baselines] [--smoke]`` (speed: about 6 minutes per
repeat, learning: about 27 minutes on 2 cores). Run it on an otherwise idle machine. The last line is machine-readable:
``async speedup one_step_off=<median> (<min>-<max>) two_step_off=<median> (<min>-<max>) repeats=<n>``
(the full-vocabulary group's one-step-off speedup, and the top-k group's two-step-off
speedup, median and range over the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness import (
    SMOKE_TRAIN_EXAMPLES,
    add_train_examples_argument,
    arithmetic_task,
    parse_arguments,
    train_examples_overrides,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"
SPLIT_1_1 = ["cluster.placement=split", "cluster.trainer.workers=1", "cluster.rollout.workers=1"]
TOPK = ["loss_fn.type=topk", "loss_fn.k=16", "cluster.teacher.placement=pool", "cluster.teacher.workers=1"]
FROZEN_LEARNING_RATE = 1e-12
"""Far below float32's resolution of the weights: a whole optimizer step that moves nothing (as in scaling.py)."""


@dataclass(frozen=True)
class Setup:
    """One measured configuration."""

    name: str
    scheduler: str
    overrides: list[str] = field(default_factory=list)


SPEED_SETUPS = [
    Setup("full-vocab sync", "sync"),
    Setup("full-vocab one_step_off", "one_step_off"),
    Setup("top-k sync", "sync", TOPK),
    Setup("top-k one_step_off", "one_step_off", TOPK),
    Setup("top-k two_step_off", "two_step_off", TOPK),
]

LEARNING_SETUPS = [
    Setup("sync", "sync"),
    Setup("one_step_off, corrected", "one_step_off", ["training.off_policy_correction.enabled=true"]),
    Setup("one_step_off, uncorrected", "one_step_off", ["training.off_policy_correction.enabled=false"]),
]


def run(setup: Setup, output: Path, overrides: list[str]) -> list[dict]:
    """One ``opd train`` run; returns its metric records."""
    command = [
        sys.executable,
        "-m",
        "opd",
        "train",
        "--config",
        str(DEMO_CONFIG),
        f"output_dir={output}",
        f"training.scheduler={setup.scheduler}",
        "training.save_freq=0",
        "checkpointing.enabled=false",
        "validation.val_at_start=false",
        "logger.console=false",
        "logger.progress_bar=false",
        *SPLIT_1_1,
        *setup.overrides,
        *overrides,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"{setup.name} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    return [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]


def measure(setup: Setup, output: Path, overrides: list[str], warmup: int) -> dict[str, float]:
    """One speed run: the medians of its steps after ``warmup``."""
    kept = [record for record in run(setup, output, overrides) if "timing/step" in record][warmup:]

    def median(key: str) -> float:
        return statistics.median(record.get(key, 0.0) for record in kept)

    step = median("timing/step")
    return {
        "steps_per_s": 1.0 / step,
        "step": step,
        "generation": median("timing/generation"),
        "wait_prev_gen": median("timing/wait_prev_gen"),
        "wait_prev_teacher": median("timing/wait_prev_teacher"),
        "teacher": median("timing/teacher"),
        "sync": median("timing/sync_rollout_weights") + median("timing/refit"),
        "training": median("timing/training"),
        "staleness": max(record.get("train/staleness_max", 0) for record in kept),
        "response": median("train/mean_response_length"),
    }


def baseline_of(name: str) -> str:
    """The sync setup a setup's speedup is taken against (its own group's)."""
    return "full-vocab sync" if name.startswith("full") else "top-k sync"


def speed(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    """The speed table (medians over ``--repeats`` interleaved repeats); returns each setup's speedup per repeat."""
    learning_rate = [] if args.learn else [f"training.learning_rate={FROZEN_LEARNING_RATE}"]
    overrides = [
        *learning_rate,
        f"training.max_num_steps={args.steps}",
        f"training.batch_size={args.batch}",
        f"training.micro_batch_size={args.batch}",
        "training.warmup_steps=0",
        "training.val_freq=0",
        "validation.val_at_end=false",
        f"distillation.generate_strategy.max_length={args.max_length}",
        *train_examples_overrides(args.train_examples),
    ]
    # The setups asked for, each with the sync run its speedup is taken against (unless --no-baselines).
    wanted = set(args.setups) | ({baseline_of(name) for name in args.setups} if args.baselines else set())
    setups = [setup for setup in SPEED_SETUPS if setup.name in wanted]
    runs: dict[str, list[dict[str, float]]] = {setup.name: [] for setup in setups}
    for repeat in range(args.repeats):
        for setup in setups:
            output = workdir / f"speed_{repeat}" / setup.name.replace(" ", "_")
            runs[setup.name].append(measure(setup, output, overrides, args.warmup))
            rate = runs[setup.name][-1]["steps_per_s"]
            print(f"... repeat {repeat + 1} {setup.name}: {rate:.3f} steps/s", file=sys.stderr, flush=True)
    rows = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]} for name, results in runs.items()
    }
    # Each repeat's speedup against the sync run of the same repeat and group (none without it).
    speedups = {
        name: [
            mine["steps_per_s"] / base["steps_per_s"]
            for mine, base in zip(results, runs.get(baseline_of(name), []), strict=False)
        ]
        for name, results in runs.items()
    }
    header = (
        f"{'setup':<26}{'steps/s':>9}{'speedup (range)':>20}{'step':>8}{'generation':>12}{'wait_gen':>10}"
        f"{'teacher':>9}{'wait_teacher':>14}{'sync':>8}{'training':>10}{'staleness':>11}{'response':>10}"
    )
    steps = f"{args.warmup + 1}-{args.steps}"
    rate = "the demo config's (--learn)" if args.learn else f"{FROZEN_LEARNING_RATE:g} (weights frozen: equal work)"
    print(
        f"speed: batch {args.batch}, rollouts of up to {args.max_length} tokens, learning rate {rate}, "
        f"medians of steps {steps}, medians over {args.repeats} repeats (speedup: median and range over repeats)"
    )
    print(header)
    print("-" * len(header))
    for setup in setups:
        row, ratios = rows[setup.name], speedups[setup.name]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "nan"
        print(
            f"{setup.name:<26}{row['steps_per_s']:>9.3f}{spread:>20}"
            f"{row['step']:>7.2f}s{row['generation']:>11.2f}s{row['wait_prev_gen']:>9.2f}s"
            f"{row['teacher']:>8.2f}s{row['wait_prev_teacher']:>13.2f}s{row['sync']:>7.3f}s"
            f"{row['training']:>9.2f}s{row['staleness']:>11}{row['response']:>10.1f}"
        )
    return speedups


def learning(args: argparse.Namespace, workdir: Path) -> None:
    """The learning table: test accuracy at equal wall-clock, mean ± std over seeds."""
    overrides = [
        f"training.max_train_time_s={args.budget_s}",
        "training.max_num_steps=1000",  # the time budget ends the run; the same LR schedule for every setup
        "training.val_freq=0",
        "validation.val_at_end=true",
        f"training.batch_size={args.batch}",
        f"training.micro_batch_size={args.batch}",
        *train_examples_overrides(args.train_examples),
    ]
    print(f"\nlearning: test accuracy after {args.budget_s:.0f} s of optimizer steps, seeds {args.seeds}")
    header = f"{'setup':<28}{'accuracy (mean ± std)':>24}{'steps (mean)':>14}{'val KL (mean)':>15}"
    results = {}
    for setup in LEARNING_SETUPS:
        accuracies, steps, kls = [], [], []
        for seed in args.seeds:
            output = workdir / f"{setup.name.replace(' ', '_').replace(',', '')}_seed{seed}"
            records = run(setup, output, [*overrides, f"training.seed={seed}"])
            final = [record for record in records if "val/accuracy" in record][-1]
            accuracies.append(final["val/accuracy"])
            kls.append(final.get("val/kl_reverse", float("nan")))
            steps.append(final["step"])
            print(
                f"... {setup.name} seed {seed}: accuracy {final['val/accuracy']:.3f} at step {final['step']}",
                file=sys.stderr,
                flush=True,
            )
        results[setup.name] = (accuracies, steps, kls)
    print(header)
    print("-" * len(header))
    for name, (accuracies, steps, kls) in results.items():
        spread = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        print(
            f"{name:<28}{statistics.mean(accuracies):>15.3f} ± {spread:.3f}"
            f"{statistics.mean(steps):>14.1f}{statistics.mean(kls):>15.4f}"
        )


SMOKE = {
    "part": "speed",
    "setups": ["top-k two_step_off"],
    "baselines": False,
    "steps": 2,
    "warmup": 1,
    "repeats": 1,
    "batch": 2,
    "max_length": 8,
    "train_examples": SMOKE_TRAIN_EXAMPLES,
}
"""``--smoke``: the top-k two-step-off run alone (no speedup), two steps of two prompts, 8-token rollouts."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["speed", "learning", "both"], default="both")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the speed runs")
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=[setup.name for setup in SPEED_SETUPS],
        default=[setup.name for setup in SPEED_SETUPS],
        metavar="SETUP",
        help="speed setups to run (each with its group's sync run); default: all",
    )
    parser.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each setup's sync baseline (--no-baselines: no speedups)",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--learn", action="store_true", help="speed runs at the demo's learning rate (see above)")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    add_train_examples_argument(parser)
    args = parse_arguments(parser, SMOKE)
    arithmetic_task()  # demo.yaml's data, generated on a fresh clone
    with tempfile.TemporaryDirectory(prefix="opd_async_") as workdir:
        speeds = speed(args, Path(workdir)) if args.part in ("speed", "both") else None
        if args.part in ("learning", "both"):
            learning(args, Path(workdir))
    if speeds is not None:

        def spread(ratios: list[float] | None) -> str:
            if not ratios:  # not among --setups, or --no-baselines
                return "nan"
            return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"

        one, two = speeds.get("full-vocab one_step_off"), speeds.get("top-k two_step_off")
        print(f"async speedup one_step_off={spread(one)} two_step_off={spread(two)} repeats={args.repeats}")


if __name__ == "__main__":
    main()
