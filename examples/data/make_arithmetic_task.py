"""Writes the CPU demo's task: multi-digit addition with a step-by-step trace.

Rows follow the math-cl format (``problem``, ``ground_truth_answer``) plus a
``solution``: the reasoning that continues the specification's prompt (which ends with
``Assistant: <think>``), then ``</think> <answer> \\boxed{N} </answer>``. The trace adds
column by column from the right, with carries, the way a person would:

    problem:  What is 347 + 589?
    solution: 7+9=16 write 6 carry 1. 4+8+1=13 write 3 carry 1. 3+5+1=9 write 9. \
So 347+589=936. </think> <answer> \\boxed{936} </answer>

``--trace`` writes the same problems with fixed answers that are *not* the teacher's
behaviour, for the λ study (``benchmarks/lambda_study.py``):

* ``reference``: a valid trace in another format, as a dataset's reference solution
  would be (``7+9 is 16, put 6, carry 1; 4+8+1 is 13, put 3, carry 1; 3+5+1 is 9, put
  9. 347+589=936.``), with the same answer tags;
* ``answer_only``: no trace at all, only ``</think> <answer> \\boxed{936} </answer>``.

Train / validation / test splits are disjoint (no problem appears twice), and the output
is deterministic for a given seed (the problems do not depend on ``--trace``). ``python -m opd.data.convert_math_cl`` or
``data.data_format: math_cl`` turns rows into chat examples with the prompt.

Usage: ``python examples/data/make_arithmetic_task.py [--digits 3] [--trace teacher] [--out-dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path


def addition_trace(a: int, b: int) -> str:
    """The column-by-column reasoning for ``a + b``, ending with the answer tags."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for position in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[position]) if position < len(digits_a) else 0
        y = int(digits_b[position]) if position < len(digits_b) else 0
        total = x + y + carry
        terms = f"{x}+{y}" + (f"+{carry}" if carry else "")
        carry = total // 10
        steps.append(f"{terms}={total} write {total % 10}" + (f" carry {carry}" if carry else ""))
    if carry:
        steps.append(f"write {carry}")
    return f"{'. '.join(steps)}. So {a}+{b}={a + b}. </think> <answer> \\boxed{{{a + b}}} </answer>"


ANSWER_TAGS = "</think> <answer> \\boxed{{{}}} </answer>"


def reference_trace(a: int, b: int) -> str:
    """A valid trace for ``a + b`` in another format than the teacher's (see the module docstring)."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    carry, steps = 0, []
    for position in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[position]) if position < len(digits_a) else 0
        y = int(digits_b[position]) if position < len(digits_b) else 0
        total = x + y + carry
        terms = f"{x}+{y}" + (f"+{carry}" if carry else "")
        carry = total // 10
        steps.append(f"{terms} is {total}, put {total % 10}" + (f", carry {carry}" if carry else ""))
    if carry:
        steps.append(f"put {carry}")
    return f"{'; '.join(steps)}. {a}+{b}={a + b}. " + ANSWER_TAGS.format(a + b)


def answer_only(a: int, b: int) -> str:
    """No trace: only the answer tags."""
    return ANSWER_TAGS.format(a + b)


TRACES = {"teacher": addition_trace, "reference": reference_trace, "answer_only": answer_only}


def make_rows(
    count: int, digits: int, rng: random.Random, seen: set[tuple[int, int]], trace: str = "teacher"
) -> list[dict]:
    """``count`` new problems whose operands have ``digits`` digits, none already in ``seen``."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    rows = []
    while len(rows) < count:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"problem": f"What is {a} + {b}?", "ground_truth_answer": str(a + b),
                     "solution": TRACES[trace](a, b)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "arithmetic"))
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=20000)
    parser.add_argument("--val-size", type=int, default=128)
    parser.add_argument("--test-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", choices=sorted(TRACES), default="teacher", help="the fixed answers' format")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    seen: set[tuple[int, int]] = set()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Test and validation first, so their problems are fixed whatever the train size.
    for name, size in (("test", args.test_size), ("val", args.val_size), ("train", args.train_size)):
        rows = make_rows(size, args.digits, rng, seen, args.trace)
        # Written whole under a private name, then renamed: a reader (another process
        # writing the same deterministic files, a test) never sees a half-written file.
        staging = out_dir / f".{name}.jsonl.{os.getpid()}"
        with open(staging, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
        os.replace(staging, out_dir / f"{name}.jsonl")
        print(f"wrote {len(rows)} problems to {out_dir / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
