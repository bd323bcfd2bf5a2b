"""The CPU demo where the tool decides the outcome (issue 36): on-policy distillation of a tool habit, against SFT.

The task is 4-digit × 3-digit multiplication (``examples/data/make_tool_task.py``): a tiny
model cannot multiply in its head, but the built-in calculator can. The teacher
(``examples/demo/models/tool_teacher``) was fine-tuned to call the calculator with the
problem's operands and box its result; the student (``tool_student``) is not a smaller
model: it is the teacher itself (the same configuration) fine-tuned 20 more steps to answer
at once, without a call, so its weights are a few percent from the teacher's. OPD here
restores a habit the student lost, not a skill it never had. Both come from
``examples/demo/prepare_tool_models.py``.

For each seed, two arms start from the same student and train for the same
``--budget-s`` seconds of training time (``training.max_train_time_s``: the steps
themselves, generation, teacher and environment included for distillation; model loading
and data preparation excluded):

* **OPD**: ``opd train`` with ``examples/configs/tool_demo.yaml`` (an ``environment:``
  section with the calculator, λ = 1: the student's own multi-turn episodes, every token
  graded by the teacher);
* **SFT**: ``opd sft`` with ``examples/configs/sft_tool.yaml`` on the teacher's recorded
  trajectories (one row per assistant turn, ``teacher_sft.jsonl``).

Every model is evaluated on the test split through opd's own multi-turn rollout
(:func:`opd.rollout.multi_turn.multi_turn_rollout`, greedy, the calculator running in
the environment): accuracy (the math verifier's grade of the final turn), tool-call rate
(the share of episodes with at least one call) and the share of calls that were well
formed. The teacher and the starting student are evaluated once (greedy: the same for
every seed). The script prints one table (mean ± std over the seeds, and each seed's
value), the OPD runs' share of step time spent in the environment
(``timing/environment`` over ``timing/step``), and writes
``benchmarks/results/tool_demo/results.json``. Its last line is machine-readable:

    tool_demo accuracy teacher=<a> before=<b> opd=<mean>+-<std> sft=<mean>+-<std>

Usage: ``python benchmarks/tool_demo.py [--seeds 0 1 2] [--budget-s 90] [--test-examples 128]
[--out DIR] [key.sub=value ...]`` (the overrides go to the OPD runs' config).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from harness import (  # noqa: E402  (benchmarks/harness.py, beside this script)
    SMOKE_TRAIN_EXAMPLES,
    add_train_examples_argument,
    parse_arguments,
    train_examples_overrides,
)

TASK = REPO / "examples" / "data" / "tool_multiplication"
MODELS = REPO / "examples" / "demo" / "models"
OPD_CONFIG = REPO / "examples" / "configs" / "tool_demo.yaml"
SFT_CONFIG = REPO / "examples" / "configs" / "sft_tool.yaml"
PROMPT_FILE = REPO / "examples" / "prompts" / "tool_math.txt"
SFT_LIKE_OPD = ("training.learning_rate=1.0e-3", "training.warmup_steps=5", "training.batch_size=16")
"""The SFT arm's optimizer settings, those of tool_demo.yaml: the arms differ in their data alone."""
MAX_TURNS = 3
"""Turns per evaluation episode: the call, the answer, and one more for a retry."""
TURN_TOKENS = 48
"""New tokens per evaluation turn (a call is about 30 with the demo's tokenizer)."""


def evaluate(model_dir: Path, rows: list[dict[str, Any]], batch_size: int = 64) -> dict[str, float]:
    """Greedy multi-turn episodes of ``model_dir`` on ``rows``, the calculator running in the environment.

    Returns ``accuracy`` (mean final reward), ``tool_call_rate`` (episodes with a call),
    ``well_formed_share`` (of all calls; None without calls), ``turns`` (per episode).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.data.converters import load_prompt_template, math_cl_to_chat
    from opd.models.decoding import GenerateStrategyConfig
    from opd.rollout.environments.config import EnvironmentConfig, build_environment
    from opd.rollout.environments.turn_template import TurnTemplate
    from opd.rollout.hf_generation import HFGeneration
    from opd.rollout.multi_turn import multi_turn_rollout

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generation = HFGeneration(model, tokenizer)
    environment = build_environment(EnvironmentConfig(tools=["calculator"], max_turns=MAX_TURNS))
    template = TurnTemplate(tokenizer, environment.tool_schemas())
    prompt_template = load_prompt_template(PROMPT_FILE)
    strategy = GenerateStrategyConfig(max_length=TURN_TOKENS, decoding_method="greedy")
    records = []
    generation.prepare_for_generation()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                chats = [math_cl_to_chat(row, prompt_template) for row in chunk]
                rollout = multi_turn_rollout(
                    generation,
                    environment,
                    template,
                    [{"ground_truth": chat["ground_truth"]} for chat in chats],
                    [chat["messages"] for chat in chats],
                    strategy,
                    MAX_TURNS,
                    tokenizer.pad_token_id,
                    return_logprobs=False,
                )
                records += rollout.episodes
    finally:
        generation.finish_generation()
    calls = sum(record.tool_calls for record in records)
    return {
        "accuracy": sum(record.reward or 0.0 for record in records) / len(records),
        "tool_call_rate": sum(record.tool_calls > 0 for record in records) / len(records),
        "well_formed_share": sum(record.well_formed_calls for record in records) / calls if calls else None,
        "turns": sum(record.turns for record in records) / len(records),
    }


def run_opd(seed: int, budget_s: float, out_dir: Path, overrides: list[str]) -> tuple[Path, dict[str, float]]:
    """``opd train`` of the student for ``budget_s`` of training time; its final model and step timings."""
    command = [
        sys.executable,
        "-m",
        "opd",
        "train",
        "--config",
        str(OPD_CONFIG),
        f"output_dir={out_dir}",
        f"training.seed={seed}",
        f"training.max_train_time_s={budget_s}",
        *overrides,
    ]
    _run(command)
    return out_dir / "final_model", step_timings(out_dir / "logs")


def run_sft(seed: int, budget_s: float, out_dir: Path, overrides: list[str]) -> tuple[Path, dict[str, float]]:
    """``opd sft`` of the student on the teacher's trajectories for ``budget_s`` of training time."""
    command = [
        sys.executable,
        "-m",
        "opd",
        "sft",
        "--config",
        str(SFT_CONFIG),
        f"output_dir={out_dir}",
        f"model.model_path={MODELS / 'tool_student'}",
        f"data.train_path={TASK / 'teacher_sft.jsonl'}",
        f"training.seed={seed}",
        f"training.max_train_time_s={budget_s}",
        "training.max_num_steps=100000",
        *overrides,
    ]
    _run(command)
    return out_dir / "final_model", step_timings(out_dir / "logs")


def _run(command: list[str]) -> None:
    """Runs an ``opd`` command in a fresh ``output_dir`` (a leftover one would be resumed or refused)."""
    output_dir = next(Path(part.split("=", 1)[1]) for part in command if part.startswith("output_dir="))
    shutil.rmtree(output_dir, ignore_errors=True)
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)


def step_timings(log_dir: Path) -> dict[str, float]:
    """Steps, summed step time and environment time from a run's ``metrics.jsonl``."""
    steps, step_s, environment_s = 0, 0.0, 0.0
    with open(log_dir / "metrics.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if "timing/step" not in record:
                continue
            steps += 1
            step_s += record["timing/step"]
            environment_s += record.get("timing/environment", 0.0)
    return {"steps": steps, "step_s": step_s, "environment_s": environment_s}


def std(values: list[float]) -> float:
    """The sample standard deviation (0 for one value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def mean_std(values: list[float | None]) -> str:
    """``mean ± std`` of ``values`` (None, a share without calls, left out; "-" if nothing is left)."""
    kept = [value for value in values if value is not None]
    return f"{statistics.mean(kept):.3f} ± {std(kept):.3f}" if kept else "-"


def cell(value: float | None) -> str:
    """A value with 3 decimals ("-" for None)."""
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budget-s", type=float, default=90.0, help="training seconds per arm and seed")
    parser.add_argument("--test-examples", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "tool_demo")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "tool_demo" / "results.json")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="OPD config overrides")
    add_train_examples_argument(parser)
    # --smoke: one seed, a few seconds per arm, a few test problems, and nothing written over
    # the committed results.
    smoke_dir = Path(tempfile.gettempdir()) / "opd_tool_demo_smoke"
    args = parse_arguments(
        parser,
        {
            "seeds": [0],
            "budget_s": 3.0,
            "test_examples": 4,
            "out": smoke_dir / "runs",
            "results": smoke_dir / "results.json",
            "train_examples": SMOKE_TRAIN_EXAMPLES,
        },
    )
    began = time.perf_counter()
    os.chdir(REPO)
    for name in ("tool_teacher", "tool_student"):
        if not (MODELS / name / "config.json").is_file():
            raise SystemExit(
                f"tool_demo: error: no model at {MODELS / name}; build the models with "
                "`python examples/demo/prepare_tool_models.py`"
            )
    if not (TASK / "teacher_sft.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_tool_task.py")], check=True)
    with open(TASK / "test.jsonl", encoding="utf-8") as handle:
        test_rows = [json.loads(line) for line in handle][: args.test_examples]

    print("== teacher and student before training", flush=True)
    teacher = evaluate(MODELS / "tool_teacher", test_rows)
    before = evaluate(MODELS / "tool_student", test_rows)
    per_seed: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        print(f"== seed {seed}: on-policy distillation, {args.budget_s:g} s", flush=True)
        training = train_examples_overrides(args.train_examples)
        opd_model, opd_timing = run_opd(seed, args.budget_s, args.out / f"opd_seed{seed}", [*training, *args.overrides])
        print(f"== seed {seed}: SFT on the teacher's trajectories, {args.budget_s:g} s", flush=True)
        sft_model, sft_timing = run_sft(seed, args.budget_s, args.out / f"sft_seed{seed}", training)
        per_seed[str(seed)] = {
            "opd": {**evaluate(opd_model, test_rows), **opd_timing},
            "sft": {**evaluate(sft_model, test_rows), **sft_timing},
        }
        print(f"   seed {seed}: {json.dumps(per_seed[str(seed)])}", flush=True)

    def column(arm: str, key: str) -> list[float]:
        return [per_seed[str(seed)][arm][key] for seed in args.seeds]

    minutes = (time.perf_counter() - began) / 60
    results = {
        "teacher": teacher,
        "student_before": before,
        "per_seed": per_seed,
        "seeds": args.seeds,
        "budget_s": args.budget_s,
        "test_examples": len(test_rows),
        "max_turns": MAX_TURNS,
        "turn_tokens": TURN_TOKENS,
        "opd_overrides": args.overrides,
        "minutes": minutes,
        "machine": f"{platform.machine()}, torch threads {os.environ.get('OMP_NUM_THREADS', 'unset')}",
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")

    print()
    print(f"test split: {len(test_rows)} problems; {len(args.seeds)} seeds; {args.budget_s:g} s of training per arm")
    print(
        f"settings: OPD {OPD_CONFIG.relative_to(REPO)} {' '.join(args.overrides)}; SFT {SFT_CONFIG.relative_to(REPO)} "
        f"{' '.join(SFT_LIKE_OPD)}; evaluation greedy, {MAX_TURNS} turns of {TURN_TOKENS} tokens at most"
    )
    print("| model | test accuracy | tool-call rate | well-formed calls |")
    print("|---|---|---|---|")
    for name, metrics in (("teacher", teacher), ("student before", before)):
        print(
            f"| {name} | {cell(metrics['accuracy'])} | {cell(metrics['tool_call_rate'])} "
            f"| {cell(metrics['well_formed_share'])} |"
        )
    for arm, name in (("opd", "student after OPD"), ("sft", "student after SFT")):
        print(
            f"| {name} (mean ± std) | {mean_std(column(arm, 'accuracy'))} | {mean_std(column(arm, 'tool_call_rate'))} "
            f"| {mean_std(column(arm, 'well_formed_share'))} |"
        )
        for seed in args.seeds:
            values = per_seed[str(seed)][arm]
            print(
                f"| &nbsp; seed {seed} ({values['steps']} steps) | {cell(values['accuracy'])} "
                f"| {cell(values['tool_call_rate'])} | {cell(values['well_formed_share'])} |"
            )
    environment_share = sum(column("opd", "environment_s")) / max(sum(column("opd", "step_s")), 1e-9)
    print(
        f"OPD: the environment took {environment_share:.1%} of the step time "
        f"(timing/environment over timing/step, all steps of all seeds); {minutes:.1f} minutes in all"
    )
    opd_accuracy, sft_accuracy = column("opd", "accuracy"), column("sft", "accuracy")
    print(
        f"tool_demo accuracy teacher={teacher['accuracy']:.3f} before={before['accuracy']:.3f} "
        f"opd={statistics.mean(opd_accuracy):.3f}+-{std(opd_accuracy):.3f} "
        f"sft={statistics.mean(sft_accuracy):.3f}+-{std(sft_accuracy):.3f}"
    )


if __name__ == "__main__":
    main()
