"""λ × kl_type sweep on the demo task, plus SFT on teacher-generated answers.

Every setting distils the demo student (``examples/demo/models/student``) from the demo
teacher with ``examples/configs/demo.yaml`` and one change: ``distillation.lambda`` ∈
{0, 0.5, 1} × ``loss_fn.kl_type`` ∈ {forward, reverse, mixed}. The baseline is
sequence-level distillation: plain SFT of the same student on the teacher's own greedy
answers to the training prompts (same optimizer, learning rate and batch size).

Each setting runs twice:

* **equal steps** — ``--steps`` optimizer steps;
* **equal wall-clock** — as many steps as fit in ``--time-budget-s`` seconds of training
  (``training.max_train_time_s``: generation, teacher and update time; validation
  excluded). The SFT baseline is charged for generating the teacher answers it trains on
  (measured per answer, batched like validation): at equal time it gets as many steps as
  fit in the budget at the cost of one SFT step plus a batch of teacher answers.

The table gives test-split accuracy (greedy, the task's 256 held-out problems) and the
final validation KL (forward and reverse, on the student's greedy answers), per setting.
One extra equal-steps row samples the on-policy answers at temperature 1 instead of the
demo's greedy decoding.
Runs go ``--jobs`` at a time, one CPU thread each, so every run sees the same load.

The demo's task is written first if it is missing (``examples/data/make_arithmetic_task.py``).

Usage: ``python benchmarks/sweep_lambda_kl.py [--steps 150] [--time-budget-s 120] [--jobs 2]
[--lambdas 0 0.5 1] [--kl-types forward reverse mixed] [--budgets steps time]
[--no-temperature-row] [--eval-examples N] [--smoke]`` (``--eval-examples`` caps the
validation and test problems of every evaluation; ``--smoke``: λ = 1 with forward KL and
SFT, 2 steps, 8 problems per evaluation, in a temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import (
    SMOKE_TRAIN_EXAMPLES,
    add_train_examples_argument,
    arithmetic_task,
    parse_arguments,
    train_examples_overrides,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "demo.yaml"
SFT_CONFIG = REPO / "examples" / "configs" / "sft_arithmetic.yaml"
TASK = REPO / "examples" / "data" / "arithmetic"
LAMBDAS = (0.0, 0.5, 1.0)
KL_TYPES = ("forward", "reverse", "mixed")
NO_STEP_CAP = 100_000  # equal wall-clock runs stop on their time budget


def run_opd(arguments: list[str], log_file: Path) -> None:
    """Runs ``python -m opd ...`` on one CPU thread; raises with the log's tail on failure."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w", encoding="utf-8") as log:
        status = subprocess.run(
            [sys.executable, "-m", "opd", *arguments], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=environment
        ).returncode
    if status != 0:
        tail = "\n".join(log_file.read_text(encoding="utf-8").splitlines()[-15:])
        raise RuntimeError(f"opd {' '.join(arguments[:3])} failed (exit {status}); log {log_file}:\n{tail}")


def common_overrides(output_dir: Path) -> list[str]:
    """Quiet, checkpoint-free runs that validate only at the end.

    The learning rate is constant after warm-up: an equal-time run does not know its
    length in advance, so a decaying schedule would not be the same for both budgets.
    """
    return [
        f"output_dir={output_dir}",
        "logger.console=false",
        "checkpointing.enabled=false",
        "training.lr_scheduler=constant_with_warmup",
        "training.val_freq=0",
        "validation.val_at_start=false",
        "validation.val_at_end=true",
    ]


def budget_overrides(steps: int | None, seconds: float | None) -> list[str]:
    if seconds is not None:
        return [f"training.max_num_steps={NO_STEP_CAP}", f"training.max_train_time_s={seconds}"]
    return [f"training.max_num_steps={steps}"]


def test_metrics(config: Path, model_dir: Path, output_dir: Path, extra: list[str]) -> dict[str, float]:
    """Test-split accuracy and KL to the teacher of ``model_dir`` (``opd eval``); ``extra`` overrides come last."""
    log_dir = output_dir / "test_eval"
    run_opd(
        [
            "eval",
            "--config",
            str(config),
            f"validation.model_path={model_dir}",
            f"data.val_path={TASK / 'test.jsonl'}",
            "data.max_val_examples=null",
            f"logger.log_dir={log_dir}",
            "logger.console=false",
            *extra,
        ],
        output_dir / "test_eval.log",
    )
    return json.loads((log_dir / "eval_metrics.json").read_text(encoding="utf-8"))


def summarise_run(output_dir: Path) -> dict[str, float]:
    """Steps, training seconds and the final validation KL from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    step_records = [r for r in records if "timing/step" in r]
    val = [r for r in records if "val/accuracy" in r][-1]
    return {
        "steps": len(step_records),
        "train_seconds": sum(r["timing/step"] for r in step_records),
        "val_kl_forward": val.get("val/kl_forward", float("nan")),
        "val_kl_reverse": val.get("val/kl_reverse", float("nan")),
    }


def distillation_setting(
    name: str, overrides: list[str], budget: list[str], root: Path, eval_overrides: list[str] | None = None
) -> dict:
    """One distillation run and its test evaluation; ``eval_overrides`` go into both (``--eval-examples``)."""
    output_dir = root / name
    evaluation = eval_overrides or []
    run_opd(
        ["train", "--config", str(CONFIG), *common_overrides(output_dir), *overrides, *budget, *evaluation],
        root / f"{name}.log",
    )
    result = summarise_run(output_dir)
    result["test_accuracy"] = test_metrics(CONFIG, output_dir / "final_model", output_dir, evaluation)["val/accuracy"]
    return {"setting": name, **result}


def make_teacher_answers(prompts: int, root: Path) -> tuple[Path, float]:
    """The teacher's greedy answers to the first ``prompts`` training problems, as math-cl rows.

    Returns the jsonl path and the seconds the generation took. A finished answers file
    (with its timing) from an earlier sweep in the same directory is reused.
    """
    path, meta_path = root / "teacher_answers.jsonl", root / "teacher_answers.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta["prompts"] == prompts and path.is_file():
            return path, meta["seconds"]
    import torch
    from transformers import AutoModelForCausalLM

    from opd.data.converters import load_prompt_template, math_cl_to_chat
    from opd.data.dataloaders import prepare_examples
    from opd.distillation.config import MasterConfig
    from opd.models.loading import load_tokenizer
    from opd.rollout.hf_generation import HFGeneration
    from opd.utils.config import load_config

    config = load_config(MasterConfig, str(CONFIG), [])
    tokenizer = load_tokenizer(config.model.teacher_model_path)
    teacher = AutoModelForCausalLM.from_pretrained(config.model.teacher_model_path, dtype=torch.float32).eval()
    template = load_prompt_template(REPO / config.data.prompt_file)
    with open(TASK / "train.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(prompts))]
    examples = prepare_examples([math_cl_to_chat(row, template) for row in rows], tokenizer, None, "train.jsonl")
    generation = HFGeneration(teacher, tokenizer)
    start = time.perf_counter()
    answers: list[str] = []
    batch = config.validation.batch_size
    for offset in range(0, len(examples), batch):
        chunk = examples[offset : offset + batch]
        out = generation.generate([e["prompt_ids"] for e in chunk], config.validation.generate_strategy)
        for row in range(len(chunk)):
            prompt_length, length = int(out["prompt_lengths"][row]), int(out["input_lengths"][row])
            answers.append(tokenizer.decode(out["input_ids"][row, prompt_length:length], skip_special_tokens=True))
    seconds = time.perf_counter() - start
    with open(path, "w", encoding="utf-8") as handle:
        for row, answer in zip(rows, answers):
            handle.write(json.dumps({**row, "solution": answer}) + "\n")
    meta_path.write_text(json.dumps({"prompts": prompts, "seconds": seconds}), encoding="utf-8")
    return path, seconds


def sft_setting(
    name: str, answers: Path, budget: list[str], root: Path, eval_overrides: list[str] | None = None
) -> dict:
    """SFT of the demo student on teacher answers, with the demo's optimizer settings."""
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    demo = load_config(MasterConfig, str(CONFIG), [])
    output_dir = root / name
    run_opd(
        [
            "sft",
            "--config",
            str(SFT_CONFIG),
            *common_overrides(output_dir),
            *budget,
            f"model.model_path={demo.model.student_model_path}",
            f"data.train_path={answers}",
            f"training.batch_size={demo.training.batch_size}",
            f"training.learning_rate={demo.training.learning_rate}",
            f"training.warmup_steps={demo.training.warmup_steps}",
            "training.num_epochs=1000",
            *(eval_overrides or []),
        ],
        root / f"{name}.log",
    )
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "train/loss" in r]
    # The distillation config's eval (same test split and decoding) also gives the KL to the teacher.
    metrics = test_metrics(CONFIG, output_dir / "final_model", output_dir, eval_overrides or [])
    return {
        "setting": name,
        "steps": len(steps),
        "train_seconds": sum(r.get("timing/step", 0.0) for r in steps),
        "test_accuracy": metrics["val/accuracy"],
        "val_kl_forward": float("nan"),
        "val_kl_reverse": float("nan"),
    }


SMOKE = {
    "steps": 2,
    "time_budget_s": 2.0,
    "lambdas": [1.0],
    "kl_types": ["forward"],
    "eval_examples": 8,
    "budgets": ["steps"],
    "temperature_row": False,
    "out": None,
    "train_examples": SMOKE_TRAIN_EXAMPLES,
}
"""``--smoke``: λ = 1 with forward KL and the SFT baseline at equal steps (2), 8 problems per evaluation, out in a
temporary directory."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of the equal-steps runs")
    parser.add_argument("--time-budget-s", type=float, default=120.0, help="training seconds of the equal-time runs")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one CPU thread each)")
    parser.add_argument("--lambdas", type=float, nargs="+", default=list(LAMBDAS), help="distillation.lambda values")
    parser.add_argument(
        "--kl-types", nargs="+", choices=KL_TYPES, default=list(KL_TYPES), help="loss_fn.kl_type values"
    )
    parser.add_argument(
        "--eval-examples", type=int, default=None, help="problems per validation and test evaluation (default: all)"
    )
    parser.add_argument(
        "--budgets", nargs="+", choices=["steps", "time"], default=["steps", "time"], help="which budgets to run"
    )
    parser.add_argument(
        "--temperature-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the equal-steps row sampled at temperature 1",
    )
    parser.add_argument("--out", type=Path, default=REPO / "results" / "sweep_lambda_kl")
    add_train_examples_argument(parser)
    args = parse_arguments(parser, SMOKE)
    with contextlib.ExitStack() as stack:
        if args.out is None:  # --smoke keeps nothing
            args.out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="opd_sweep_smoke_")))
        sweep(args)


def sweep(args: argparse.Namespace) -> None:
    """The sweep's runs and its table, written under ``args.out``."""
    sys.path.insert(0, str(REPO))
    args.out.mkdir(parents=True, exist_ok=True)
    arithmetic_task(TASK)
    evaluation = [] if args.eval_examples is None else [f"data.max_val_examples={args.eval_examples}"]
    training = train_examples_overrides(args.train_examples)

    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    batch_size = load_config(MasterConfig, str(CONFIG), []).training.batch_size
    print(f"teacher answers for {args.steps * batch_size} training prompts ...", flush=True)
    answers, answer_seconds = make_teacher_answers(args.steps * batch_size, args.out)
    per_prompt = answer_seconds / (args.steps * batch_size)
    print(f"  {answer_seconds:.1f} s ({per_prompt * 1000:.1f} ms per prompt)", flush=True)

    jobs = []
    budgets = [("steps", args.steps, None), ("time", None, args.time_budget_s)]
    for budget_name, steps, seconds in [budget for budget in budgets if budget[0] in args.budgets]:
        budget = budget_overrides(steps, seconds)
        for lam in args.lambdas:
            for kl in args.kl_types:
                name = f"{budget_name}/lambda{lam:g}_{kl}"
                overrides = [f"distillation.lambda={lam}", f"loss_fn.kl_type={kl}", *training]
                setting = functools.partial(distillation_setting, name, overrides, budget, args.out, evaluation)
                jobs.append((budget_name, setting))
        if seconds is None and args.temperature_row:
            # The demo samples greedily; this row shows what temperature-1 sampling does instead.
            temperature_1 = [
                "distillation.lambda=1.0",
                "loss_fn.kl_type=forward",
                "distillation.generate_strategy.decoding_method=top_p",
                "distillation.generate_strategy.temperature=1.0",
                *training,
            ]
            setting = functools.partial(
                distillation_setting, "steps/lambda1_forward_temp1", temperature_1, budget, args.out, evaluation
            )
            jobs.append((budget_name, setting))

    def sft_both_budgets() -> list[dict]:
        """Equal steps first; its step time then sizes the equal-time run.

        At equal wall-clock SFT pays for the teacher answers it consumes: each of its steps
        costs one SFT step plus ``batch_size`` teacher answers (measured above), so it gets
        as many steps as fit in the budget at that combined cost.
        """
        equal_steps = sft_setting(
            "steps/sft_teacher_answers", answers, budget_overrides(args.steps, None), args.out, evaluation
        )
        if "time" not in args.budgets:
            return [equal_steps]
        step_cost = equal_steps["train_seconds"] / equal_steps["steps"] + batch_size * per_prompt
        steps_in_budget = max(int(args.time_budget_s // step_cost), 1)
        equal_time = sft_setting(
            "time/sft_teacher_answers", answers, budget_overrides(steps_in_budget, None), args.out, evaluation
        )
        equal_time["train_seconds"] += steps_in_budget * batch_size * per_prompt  # charged answer time
        return [equal_steps, equal_time]

    jobs.insert(0, ("sft", sft_both_budgets))  # first: its two runs are sequential

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(job) for _, job in jobs]
        results = []
        for future in futures:
            outcome = future.result()
            for result in outcome if isinstance(outcome, list) else [outcome]:
                result["budget"] = result["setting"].split("/", 1)[0]
                results.append(result)
                print(
                    f"  done {result['setting']}: test accuracy {result['test_accuracy']:.3f} "
                    f"after {result['steps']} steps",
                    flush=True,
                )
    (args.out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")

    print()
    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{args.jobs} runs at a time (1 thread each); total {(time.perf_counter() - start) / 60:.1f} min"
    )
    print(
        f"equal steps = {args.steps} steps; equal wall-clock = {args.time_budget_s:g} s of training "
        f"(the equal-time SFT row's train s include {per_prompt * 1000:.0f} ms of teacher generation per answer "
        f"it trains on; the equal-steps row's exclude the {answer_seconds:.0f} s its answers took)"
    )
    header = (
        f"{'setting':<28} {'budget':<6} {'steps':>6} {'train s':>8} {'test acc':>9} {'val KL fwd':>11} "
        f"{'val KL rev':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        kl = "".join(
            f" {value:>11.4f}" if value == value else f" {'-':>11}"  # SFT has no teacher KL
            for value in (r["val_kl_forward"], r["val_kl_reverse"])
        )
        print(
            f"{r['setting'].split('/', 1)[1]:<28} {r['budget']:<6} {r['steps']:>6} {r['train_seconds']:>8.0f} "
            f"{r['test_accuracy']:>9.3f}{kl}"
        )


if __name__ == "__main__":
    main()
