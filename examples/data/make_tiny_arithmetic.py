"""Writes the small chat dataset of the smoke-test config (distillation_tiny.yaml) and the tests.

Two-digit additions and subtractions in the Hugging Face chat format, with a short
worked answer ending in ``\\boxed{}`` and the ground truth kept for validation. Output is
deterministic (fixed seed), and train / validation prompts are disjoint.

Usage: ``python examples/data/make_tiny_arithmetic.py [--out-dir examples/data/tiny_arithmetic]``
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """Returns ``(question, worked answer, ground truth)`` for one random problem."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        expression, result = f"{a} + {b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        expression, result = f"{a} - {b}", a - b
    return f"What is {expression}?", f"{expression} = {result}. The answer is \\boxed{{{result}}}.", str(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "tiny_arithmetic"))
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < args.train_size + args.val_size:
        question, answer, truth = make_problem(rng)
        if question in seen:  # keeps the splits disjoint
            continue
        seen.add(question)
        rows.append(
            {
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "ground_truth": truth,
            }
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[: args.train_size]), ("val", rows[args.train_size :])):
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for row in part:
                handle.write(json.dumps(row) + "\n")
        print(f"wrote {len(part)} examples to {out_dir / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
