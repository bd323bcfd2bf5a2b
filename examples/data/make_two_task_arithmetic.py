"""Writes the two-teacher demo's task: 3-digit addition and subtraction, each row tagged with its ``task``.

Addition rows are the demo task's own (``examples/data/arithmetic``, written by
``make_arithmetic_task.py``), so the demo teacher, trained on that task's training split,
is the addition expert and never saw a test problem. Subtraction rows (``a - b`` with
``a >= b``) are new, with a trace in the same style, column by column from the right,
borrowing where needed:

    problem:  What is 936 - 589?
    solution: 6-9+10=7 write 7 borrow 1. 3-1-8+10=4 write 4 borrow 1. 9-1-5=3 write 3. \
So 936-589=347. </think> <answer> \\boxed{347} </answer>

Files (``examples/data/arithmetic_two_tasks/``):

* ``train_sub.jsonl`` / ``val_sub.jsonl``: subtraction only (the subtraction expert's SFT);
* ``train.jsonl`` / ``val.jsonl``: both tasks interleaved, with ``"task": "add" | "sub"``
  (the student's SFT and the distillation runs route on ``task``);
* ``test_add.jsonl`` / ``test_sub.jsonl``: each expert's test split.

The output is deterministic; no problem appears in two splits.

Usage: ``python examples/data/make_two_task_arithmetic.py [--out-dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def subtraction_trace(a: int, b: int) -> str:
    """The column-by-column reasoning for ``a - b`` (``a >= b``), ending with the answer tags."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    borrow, steps = 0, []
    for position in range(len(digits_a)):
        x = int(digits_a[position])
        y = int(digits_b[position]) if position < len(digits_b) else 0
        terms = f"{x}-{borrow}-{y}" if borrow else f"{x}-{y}"
        value = x - borrow - y
        if value < 0:
            steps.append(f"{terms}+10={value + 10} write {value + 10} borrow 1")
            borrow = 1
        else:
            steps.append(f"{terms}={value} write {value}")
            borrow = 0
    return f"{'. '.join(steps)}. So {a}-{b}={a - b}. </think> <answer> \\boxed{{{a - b}}} </answer>"


def subtraction_rows(count: int, rng: random.Random, seen: set[tuple[int, int]]) -> list[dict]:
    """``count`` new 3-digit problems ``a - b`` with ``a >= b``, none already in ``seen``."""
    rows = []
    while len(rows) < count:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        a, b = max(a, b), min(a, b)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"problem": f"What is {a} - {b}?", "ground_truth_answer": str(a - b),
                     "solution": subtraction_trace(a, b), "task": "sub"})
    return rows


def addition_rows(split: str, count: int) -> list[dict]:
    """The first ``count`` rows of the addition task's ``split``, tagged ``task: add``."""
    path = HERE / "arithmetic" / f"{split}.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run examples/data/make_arithmetic_task.py first")
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(count))]
    return [{**row, "task": "add"} for row in rows]


def write(path: Path, rows: list[dict]) -> None:
    """Writes ``rows`` whole under a private name, then renames (no reader sees half a file)."""
    staging = path.parent / f".{path.name}.{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(staging, path)
    print(f"wrote {len(rows)} problems to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(HERE / "arithmetic_two_tasks"))
    parser.add_argument("--train-size", type=int, default=6000, help="problems per task in the mixed train split")
    parser.add_argument("--sub-train-size", type=int, default=12000, help="subtraction expert's SFT problems")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seen: set[tuple[int, int]] = set()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Test and validation first, so their problems are fixed whatever the train sizes.
    test_sub = subtraction_rows(256, rng, seen)
    val_sub = subtraction_rows(128, rng, seen)
    train_sub = subtraction_rows(args.sub_train_size, rng, seen)
    write(out / "test_sub.jsonl", test_sub)
    write(out / "val_sub.jsonl", val_sub)
    write(out / "train_sub.jsonl", train_sub)
    write(out / "test_add.jsonl", addition_rows("test", 256))
    mixed_val = addition_rows("val", 64) + val_sub[:64]
    mixed_train = addition_rows("train", args.train_size) + train_sub[: args.train_size]
    random.Random(args.seed + 1).shuffle(mixed_val)
    random.Random(args.seed + 2).shuffle(mixed_train)
    write(out / "val.jsonl", mixed_val)
    write(out / "train.jsonl", mixed_train)


if __name__ == "__main__":
    main()
