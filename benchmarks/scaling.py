"""Scaling of the cluster path on CPU: 1 against 2 trainer workers, colocated against split pools.

Every configuration is one ``opd train`` run of the CPU demo (its committed tiny teacher
and student, greedy on-policy rollouts of up to 96 tokens, the exact fused full-vocabulary
loss with the teacher colocated in the trainer workers), in a fresh process with its own
private Ray cluster, one thread per worker. Weak scaling: each trainer worker (and each
rollout worker) gets ``--per-worker-batch`` prompts, so 2 workers train a global batch
twice as large. Validation and checkpoints are off; the first ``--warmup`` steps are
dropped and the medians of the rest are reported.

Equal work per sample. Weak scaling compares runs that do the same work per worker. A
student that learns drifts, and it drifts differently with a global batch of 16 than of
32: its greedy responses get longer or shorter, and the two runs no longer generate and
train the same number of tokens per sample. So by default every run trains with a
learning rate of 1e-12: each step does all the work of a real step (generation, refit,
teacher, forward, backward, AdamW), the weights do not move, and the responses keep the
length distribution they start with (the ``response`` column shows it). ``--learn`` runs
the demo's learning rate instead.

Cluster settings. The headline runs keep each student layer's gathered weights from
forward to backward (``cluster.trainer.reshard_after_forward=false``) and a whole teacher
in each trainer worker (``cluster.teacher.sharded=false``): at the demo's size (a teacher
of a few MB) that is what a user would choose, since it saves collectives and memory is
no concern.

Three figures, side by side (``--variants``; default all three, interleaved within each
repeat), each changing one thing from the headline:

* ``headline``: frozen weights (learning rate 1e-12), the small-model cluster settings;
* ``fsdp-defaults``: frozen weights, FSDP2's defaults (every layer gathered again for the
  backward, the teacher sharded too), what a run gets without those two settings;
* ``learning``: the demo's learning rate (the responses drift apart, see above), the
  small-model cluster settings.

Columns, all medians per step, from the run's ``metrics.jsonl``:

* ``samples/s``: sequences trained per second of step time; ``response``: the mean
  response length in tokens;
* ``generation``, ``refit``, ``teacher`` (in process: the teacher's forward; on the cluster
  the colocated teacher's time on the slowest rank, part of the trainer call), ``training``
  (``timing/training``: the call to the trainer workers without their teacher time),
  ``dispatch`` (the controller planning each rank's micro-batches) and ``step``;
* ``overhead``: the controller's share of a step, the step time minus the time the
  workers computed (``timing/trainer_compute``, the slowest rank) and minus generation
  and refit (themselves worker calls): the cost of the controller and of Ray's calls;
* ``refit MB``: the bytes the step's refit gathered (``refit/bytes``: one copy of the
  student in the rollout engines' dtype) and, after the slash, what the rollout workers
  received (``refit/bytes_delivered``: one copy each).

Weak-scaling efficiency = samples/s of 2 workers / (2 × samples/s of 1 worker), colocated.

Run-to-run noise on a shared 2-core machine is of the same size as the effect measured
(a phase can take 0.35 s in one run and 0.47 s in the next), so the cluster setups run
``--repeats`` times, interleaved (1+1, 2+2, 1+1, 2+2, ...), and each efficiency is taken
within one repeat, from runs made back to back. The table shows the median over repeats
of every column; the efficiency line gives the median and the range over repeats.

The demo's task is written first if it is missing (``examples/data/make_arithmetic_task.py``).

Usage: ``python benchmarks/scaling.py [--steps 24] [--warmup 4] [--per-worker-batch 16]
[--repeats 3] [--variants VARIANT ...] [--setups SETUP ...] [--smoke]`` (about 2.5 minutes
per repeat and variant on 2 cores: about 23 minutes with the defaults). ``--setups`` runs
some of the setups (a ratio whose two runs are not both there reads ``nan``).
Run it on an otherwise idle machine. The last line is machine-readable:
``scaling weak_efficiency=<headline median> controller_overhead=<median fraction>
fsdp_defaults_efficiency=<median> learning_efficiency=<median> refit_bytes=<per step, 2+2>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    SMOKE_TRAIN_EXAMPLES,
    add_train_examples_argument,
    arithmetic_task,
    parse_arguments,
    train_examples_overrides,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "examples" / "configs" / "demo.yaml"


@dataclass(frozen=True)
class Setup:
    """One measured configuration."""

    name: str
    workers: int  # trainer workers (and rollout workers); 0 = in process, no Ray
    placement: str = "colocated"


SETUPS = [
    Setup("in-process", 0),
    Setup("colocated 1+1", 1),
    Setup("colocated 2+2", 2),
    Setup("split 1+1", 1, "split"),
    Setup("split 2+2", 2, "split"),
]


FROZEN_LEARNING_RATE = 1e-12
"""Far below float32's resolution of the weights: a whole optimizer step that moves nothing."""
SMALL_MODEL_CLUSTER_SETTINGS = ("cluster.trainer.reshard_after_forward=false", "cluster.teacher.sharded=false")


@dataclass(frozen=True)
class Variant:
    """One figure: a learning rate and the cluster settings (see the module docstring)."""

    name: str
    learn: bool
    cluster_settings: tuple[str, ...]

    def describe(self) -> str:
        rate = "the demo's learning rate" if self.learn else f"learning rate {FROZEN_LEARNING_RATE} (equal work)"
        settings = " ".join(self.cluster_settings) or "FSDP2 defaults (reshard_after_forward, the teacher sharded)"
        return f"{rate}; {settings}"


VARIANTS = [
    Variant("headline", False, SMALL_MODEL_CLUSTER_SETTINGS),
    Variant("fsdp-defaults", False, ()),
    Variant("learning", True, SMALL_MODEL_CLUSTER_SETTINGS),
]


def run(
    setup: Setup,
    steps: int,
    per_worker_batch: int,
    workdir: Path,
    learn: bool = False,
    cluster_settings: tuple[str, ...] = (),
    train_examples: int | None = None,
) -> list[dict]:
    """Runs one configuration in a fresh ``workdir`` and returns its per-step metric records.

    Args:
        setup: the configuration.
        steps: optimizer steps.
        per_worker_batch: prompts per trainer (and rollout) worker.
        workdir: where the run's output directory goes.
        learn: train at the demo's learning rate (else at ``FROZEN_LEARNING_RATE``).
        cluster_settings: overrides added to a cluster run.
        train_examples: rows of the training data the run reads (None: all).
    """
    output = workdir / setup.name.replace(" ", "_").replace("+", "_")
    batch = per_worker_batch * max(setup.workers, 1)
    overrides = [
        f"output_dir={output}",
        f"training.max_num_steps={steps}",
        f"training.batch_size={batch}",
        f"training.micro_batch_size={per_worker_batch}",
        "training.warmup_steps=0",
        "training.val_freq=0",
        "training.save_freq=0",
        "checkpointing.enabled=false",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "logger.console=false",
        "logger.progress_bar=false",
        *train_examples_overrides(train_examples),
    ]
    if not learn:
        overrides.append(f"training.learning_rate={FROZEN_LEARNING_RATE}")
    if setup.workers:
        overrides += [
            f"cluster.trainer.workers={setup.workers}",
            f"cluster.rollout.workers={setup.workers}",
            f"cluster.placement={setup.placement}",
            *cluster_settings,
        ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    completed = subprocess.run(
        [sys.executable, "-m", "opd", "train", "--config", str(DEMO_CONFIG), *overrides],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )
    if completed.returncode != 0:
        raise SystemExit(f"{setup.name} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    lines = (output / "logs" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "timing/step" in record]


def summarize(records: list[dict], warmup: int) -> dict[str, float]:
    """Medians over the steps after the warm-up."""
    kept = records[warmup:]

    def median(key: str) -> float:
        return statistics.median(record.get(key, 0.0) for record in kept)

    step = median("timing/step")
    phases = ("generation", "refit", "teacher", "training", "dispatch", "step")
    summary = {key: median(f"timing/{key}") for key in phases}
    summary["response"] = median("train/mean_response_length")
    summary["refit_bytes"] = median("refit/bytes")
    summary["refit_bytes_delivered"] = median("refit/bytes_delivered")
    compute = median("timing/trainer_compute")
    if compute:
        worker_time = compute + summary["generation"] + summary["refit"]
        summary["overhead"] = max(step - worker_time, 0.0) / step
    else:
        summary["overhead"] = float("nan")
    return summary


def median_summary(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Every column's median over the repeats of one setup."""
    return {key: statistics.median(summary[key] for summary in summaries) for key in summaries[0]}


SMOKE = {
    "steps": 2,
    "warmup": 1,
    "per_worker_batch": 2,
    "repeats": 1,
    "setups": ["colocated 1+1"],
    "variants": ["headline"],
    "train_examples": SMOKE_TRAIN_EXAMPLES,
}
"""``--smoke``: one run on a Ray cluster of one trainer and one rollout worker, two steps (every ratio reads nan)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[variant.name for variant in VARIANTS],
        default=[variant.name for variant in VARIANTS],
        metavar="VARIANT",
        help="figures to measure (see the docstring); default: all three",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=[setup.name for setup in SETUPS],
        default=[setup.name for setup in SETUPS],
        metavar="SETUP",
        help="setups to run; default: all",
    )
    add_train_examples_argument(parser)
    args = parse_arguments(parser, SMOKE)
    arithmetic_task()  # demo.yaml's data, generated on a fresh clone
    setups = [setup for setup in SETUPS if setup.name in args.setups]
    variants = [variant for variant in VARIANTS if variant.name in args.variants]

    runs: dict[tuple[str, str], list[dict[str, float]]] = {
        (variant.name, setup.name): [] for variant in variants for setup in setups
    }
    with tempfile.TemporaryDirectory(prefix="opd_scaling_") as workdir:
        for repeat in range(args.repeats):
            for variant in variants:
                # In process needs no repeat for the ratios; one run gives the reference row.
                for setup in setups if repeat == 0 else [setup for setup in setups if setup.workers]:
                    records = run(
                        setup,
                        args.steps,
                        args.per_worker_batch,
                        Path(workdir) / f"repeat_{repeat}" / variant.name,
                        variant.learn,
                        variant.cluster_settings,
                        args.train_examples,
                    )
                    summary = summarize(records, args.warmup)
                    summary["samples_per_s"] = args.per_worker_batch * max(setup.workers, 1) / summary["step"]
                    runs[(variant.name, setup.name)].append(summary)
                    print(
                        f"... repeat {repeat + 1}/{args.repeats} {variant.name} {setup.name}: "
                        f"{summary['samples_per_s']:.2f} samples/s",
                        file=sys.stderr,
                        flush=True,
                    )

    figures = {variant.name: print_variant(variant, setups, runs, args) for variant in variants}

    print("\nweak scaling 1 -> 2 workers, median (range) over repeats, each figure beside the headline:")
    print(f"{'figure':<15}{'colocated':<20}{'split':<20}{'1 worker vs in-process':<24}settings")
    for variant in variants:
        figure = figures[variant.name]
        print(
            f"{variant.name:<15}{spread(figure['colocated']):<20}{spread(figure['split']):<20}"
            f"{figure['one_worker']:<24.2f}{variant.describe()}"
        )

    def efficiency(name: str) -> float:
        return median_or_nan(figures[name]["colocated"]) if name in figures else float("nan")

    headline = figures.get("headline", {})
    print(
        f"scaling weak_efficiency={efficiency('headline'):.3f} "
        f"controller_overhead={headline.get('overhead', float('nan')):.4f} "
        f"fsdp_defaults_efficiency={efficiency('fsdp-defaults'):.3f} "
        f"learning_efficiency={efficiency('learning'):.3f} "
        f"refit_bytes={headline.get('refit_bytes', float('nan')):.0f}"
    )


def print_variant(
    variant: Variant, setups: list[Setup], runs: dict[tuple[str, str], list[dict[str, float]]], args: Any
) -> dict[str, Any]:
    """Prints one figure's table; returns its efficiencies (one per repeat), overhead and refit bytes."""
    header = (
        f"{'setup':<16}{'batch':>6}{'samples/s':>11}{'response':>10}{'generation':>12}{'refit':>8}{'teacher':>9}"
        f"{'training':>10}{'dispatch':>10}{'step':>8}{'overhead':>10}{'refit MB':>17}"
    )
    print(f"\n{variant.name}: {variant.describe()}; medians over {args.repeats} repeats (in-process: 1 run)")
    print(header)
    print("-" * len(header))
    mine = {setup.name: runs[(variant.name, setup.name)] for setup in setups}
    for setup in setups:
        summary = median_summary(mine[setup.name])
        batch = args.per_worker_batch * max(setup.workers, 1)
        moved = (
            f"{summary['refit_bytes'] / 1e6:.3f}/{summary['refit_bytes_delivered'] / 1e6:.3f}"
            if summary["refit_bytes"]
            else "-"
        )
        print(
            f"{setup.name:<16}{batch:>6}{summary['samples_per_s']:>11.2f}{summary['response']:>10.1f}"
            f"{summary['generation']:>11.2f}s"
            f"{summary['refit']:>7.3f}s{summary['teacher']:>8.2f}s{summary['training']:>9.2f}s"
            f"{summary['dispatch']:>9.4f}s"
            f"{summary['step']:>7.2f}s{summary['overhead']:>10.1%}{moved:>17}"
        )

    def efficiencies(one: str, two: str) -> list[float]:
        """Weak-scaling efficiency of each repeat, from its two back-to-back runs (none if one is not run)."""
        if one not in mine or two not in mine:
            return []
        return [b["samples_per_s"] / (2 * a["samples_per_s"]) for a, b in zip(mine[one], mine[two], strict=True)]

    one_worker = float("nan")
    if "colocated 1+1" in mine and "in-process" in mine:
        one_worker = median_summary(mine["colocated 1+1"])["samples_per_s"] / mine["in-process"][0]["samples_per_s"]
    two = median_summary(mine["colocated 2+2"]) if "colocated 2+2" in mine else {}
    return {
        "colocated": efficiencies("colocated 1+1", "colocated 2+2"),
        "split": efficiencies("split 1+1", "split 2+2"),
        "one_worker": one_worker,
        "overhead": two.get("overhead", float("nan")),
        "refit_bytes": two.get("refit_bytes", float("nan")),
    }


def spread(values: list[float]) -> str:
    if not values:
        return "nan"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


if __name__ == "__main__":
    main()
