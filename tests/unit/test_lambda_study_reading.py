"""How ``benchmarks/lambda_study.py`` reads its runs: charged time, the two budgets and the headline.

The study's equal-wall-clock comparison rests on three small functions: the learning curve
that charges teacher-sample generation to the steps that used it, the linear interpolation
of a curve at a time budget, and the headline line that picks the best fixed-data and SFT
rows. Each is checked here against a plain reference on random inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def study():
    """The benchmark script as a module (it is not part of the ``opd`` package)."""
    spec = importlib.util.spec_from_file_location("lambda_study_under_test", BENCHMARKS / "lambda_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def random_records(rng: random.Random, steps: int, eval_every: int) -> list[dict]:
    records = []
    for step in range(1, steps + 1):
        on_policy = float(rng.random() < 0.5)
        records.append({"step": step, "timing/step": rng.uniform(0.2, 2.0), "train/on_policy": on_policy})
        if step % eval_every == 0:
            records.append({"step": step, "val/accuracy": rng.random(), "val/kl_forward": rng.uniform(0, 3)})
    return records


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sft", [False, True])
def test_learning_curve_charges_generation_only_to_fixed_data_steps(study, seed, sft):
    rng = random.Random(seed)
    records = random_records(rng, steps=37, eval_every=5)
    per_batch = 0.65
    curve = study.learning_curve(records, sft, per_batch)

    steps = [r for r in records if "timing/step" in r]
    times = np.array([r["timing/step"] for r in steps], dtype=np.float64)
    fixed = np.array([sft or r["train/on_policy"] == 0.0 for r in steps])
    evals = [r for r in records if "val/accuracy" in r]
    assert [point["step"] for point in curve] == [r["step"] for r in evals] == [5, 10, 15, 20, 25, 30, 35]
    for point, evaluation in zip(curve, evals, strict=True):
        done = evaluation["step"]
        assert point["train_seconds"] == pytest.approx(times[:done].sum(), rel=1e-12)
        assert point["charged_seconds"] == pytest.approx(times[:done].sum() + per_batch * fixed[:done].sum(), rel=1e-12)
        assert point["accuracy"] == evaluation["val/accuracy"]
        assert point["kl_forward"] == evaluation["val/kl_forward"]
        assert point["kl_reverse"] is None


def test_learning_curve_charges_nothing_for_a_free_source(study):
    records = random_records(random.Random(3), steps=20, eval_every=10)
    curve = study.learning_curve(records, sft=True, per_batch=0.0)
    assert [p["charged_seconds"] for p in curve] == [p["train_seconds"] for p in curve]


@pytest.mark.parametrize("seed", range(5))
def test_at_time_interpolates_the_curve_linearly(study, seed):
    rng = np.random.default_rng(seed)
    charged = np.cumsum(rng.uniform(5, 60, size=8))
    accuracy, kl = rng.uniform(0, 1, size=8), rng.uniform(0, 3, size=8)
    result = {"curve": [{"step": 50 * (i + 1), "charged_seconds": float(charged[i]), "accuracy": float(accuracy[i]),
                         "kl_forward": float(kl[i]), "kl_reverse": None} for i in range(8)]}
    for seconds in rng.uniform(charged[0], charged[-1], size=20):
        point = study.at_time(result, float(seconds))
        assert point["accuracy"] == pytest.approx(np.interp(seconds, charged, accuracy), abs=1e-12)
        assert point["kl_forward"] == pytest.approx(np.interp(seconds, charged, kl), abs=1e-12)
        assert point["step"] == pytest.approx(np.interp(seconds, charged, 50 * np.arange(1, 9)), abs=1e-9)
        assert point["kl_reverse"] is None
    # On an evaluation: that evaluation; outside the curve: nothing.
    assert study.at_time(result, float(charged[3]))["accuracy"] == accuracy[3]
    assert study.at_time(result, float(charged[-1]) + 1.0) is None
    assert study.at_time(result, float(charged[0]) - 1.0) is None
    assert study.at_time({"curve": []}, 10.0) is None


def test_at_steps_reads_the_evaluation_at_that_step(study):
    result = {"curve": [{"step": 50, "accuracy": 0.1}, {"step": 100, "accuracy": 0.4}]}
    assert study.at_steps(result, 100)["accuracy"] == 0.4
    assert study.at_steps(result, 150) is None


def constant_run(scenario: str, setting: str, seed: int, accuracy: float) -> dict:
    """A run whose curve sits at ``accuracy`` from 50 to 400 steps, one charged second per step."""
    return {"scenario": scenario, "setting": setting, "seed": seed,
            "curve": [{"step": step, "charged_seconds": float(step), "accuracy": accuracy,
                       "kl_forward": 0.5, "kl_reverse": None} for step in (50, 100, 150, 200, 400)]}


def headline_args(scenarios: list[str]) -> argparse.Namespace:
    return argparse.Namespace(jobs=2, seeds=[0, 1, 2], steps=150, time_budget_s=200.0, eval_every=50,
                              scenarios=scenarios)


def test_headline_compares_lambda1_with_the_best_fixed_data_and_sft_rows(study, capsys):
    accuracies = {"lambda1_forward": [0.7, 0.8, 0.9], "lambda0_teacher_samples_forward": [0.2, 0.3, 0.4],
                  "lambda0_reference_forward": [0.5, 0.5, 0.8], "lambda0_answer_only_forward": [0.0, 0.0, 0.0],
                  "sft_teacher_samples": [0.6, 0.6, 0.6], "sft_reference": [0.1, 0.2, 0.3],
                  "lambda0.5_reference_forward": [0.99, 0.99, 0.99]}  # not a λ = 0 row: never the headline's
    results = [constant_run("demo", name, seed, value)
               for name, values in accuracies.items() for seed, value in enumerate(values)]
    results.append(constant_run("student_small", "lambda1_forward", 0, 1.0))  # another scenario: not the headline's
    study.print_tables(results, headline_args(["demo", "student_small"]), seconds=60.0)
    last = capsys.readouterr().out.strip().splitlines()[-1]

    def cell(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f}+-{statistics.stdev(values):.3f}"

    assert last == (f"lambda_study equal_time lambda1={cell(accuracies['lambda1_forward'])} "
                    f"lambda0={cell(accuracies['lambda0_reference_forward'])} "
                    f"sft={cell(accuracies['sft_teacher_samples'])}")


def test_no_headline_without_the_demo_pair(study, capsys):
    results = [constant_run("student_tiny", "lambda1_forward", seed, 0.0) for seed in range(3)]
    study.print_tables(results, headline_args(["student_tiny"]), seconds=60.0)
    out = capsys.readouterr().out
    assert "scenario student_tiny" in out
    assert "lambda_study equal_time" not in out
