"""How long ``opd train`` takes to prepare a data set: one tokenizer call per block of texts against one per text.

Before the first step, :func:`opd.data.dataloaders.prepare_examples` renders every example's
prompt and fixed answer with the chat template and tokenizes them. It calls the tokenizer
once per block of 4,096 texts (:func:`opd.data.sequences.encode_texts`; a fast tokenizer
encodes a batch in Rust). The reference is the same code with blocks of one text, one call
per prompt and one per answer, as before the blocks; the script checks that the two give the
same ids before it times anything.

The data is the demo's arithmetic task (its chat template, prompt file and 455-entry
tokenizer; 20,000 training rows, each a 151-token prompt and a 70-token answer). Reported:
the median and range of ``--repeats`` timed preparations of each way, after one untimed
one, and their ratio. Run::

    OMP_NUM_THREADS=1 python benchmarks/data_preparation.py [--rows 20000] [--repeats 3]

(``--smoke``: 500 rows, one timed preparation of each.)
"""

from __future__ import annotations

import argparse
import os

from harness import DEMO_TASK, REPO, arithmetic_task
from timing import median_and_range
from transformers import AutoTokenizer

import opd.data.sequences as sequences
from opd.data.dataloaders import prepare_examples
from opd.data.datasets import load_chat_dataset

TOKENIZER = REPO / "examples" / "demo" / "models" / "student"
PROMPT_FILE = REPO / "examples" / "prompts" / "math_think_answer.txt"
MAX_PROMPT_LENGTH = 512
"""``demo.yaml``'s ``data.max_prompt_length``."""


def prepare(rows: list[dict], tokenizer, block: int) -> list:
    """``prepare_examples`` of ``rows`` with ``block`` texts per tokenizer call."""
    default, sequences.ENCODE_BLOCK = sequences.ENCODE_BLOCK, block
    try:
        return prepare_examples(rows, tokenizer, MAX_PROMPT_LENGTH, "train.jsonl")
    finally:
        sequences.ENCODE_BLOCK = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="training rows of the demo task to prepare")
    parser.add_argument("--repeats", type=int, default=3, help="timed preparations of each way")
    parser.add_argument("--smoke", action="store_true", help="500 rows, one timed preparation of each")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.repeats = 500, 1
    task = arithmetic_task(DEMO_TASK)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    rows = load_chat_dataset(
        str(task / "train.jsonl"),
        split="train",
        max_examples=args.rows,
        data_format="math_cl",
        prompt_file=str(PROMPT_FILE),
    )

    def blocks() -> list:
        return prepare(rows, tokenizer, sequences.ENCODE_BLOCK)

    def per_text() -> list:
        return prepare(rows, tokenizer, 1)

    if blocks() != per_text():
        raise SystemExit("data_preparation: the two ways prepared different ids")
    print(
        f"{len(rows):,} rows of the demo task, {os.environ.get('OMP_NUM_THREADS', 'default')} OpenMP threads, "
        f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset (on)')}; "
        f"median [min-max] of {args.repeats} timed preparations after one untimed"
    )
    timings = {
        name: median_and_range(call, args.repeats) for name, call in (("blocks", blocks), ("per_text", per_text))
    }
    for name, label in (("per_text", "one tokenizer call per text"), ("blocks", "one call per block of 4,096")):
        median, low, high = timings[name]
        print(f"  {label:<30} {median:7.2f} s [{low:.2f}-{high:.2f}]")
    ratio = timings["blocks"][0] / timings["per_text"][0]
    print(f"data_preparation rows={len(rows)} blocks_over_per_text={ratio:.2f}")


if __name__ == "__main__":
    main()
