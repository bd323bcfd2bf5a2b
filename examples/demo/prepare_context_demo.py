"""Builds the context-distillation demo: a model that does better with a hint it will lose.

The hint is each problem's column sums, right to left ("Hint: the column sums, right to
left, are 16, 13, 9."): real help, since a model that reads them only has to copy them
into its trace, but not the answer text itself. Steps:

1. writes the arithmetic task if missing, then chat-format copies of it under
   ``examples/data/arithmetic_hints/``: ``sft.jsonl`` (train problems, half of them with
   the hint before the question, the worked solution as the assistant turn) and
   ``{train,val,test}.jsonl`` (the question only, the hint in a ``hint`` field for
   ``distillation.teacher_context_key``);
2. initialises a model of the demo student's shape for the demo tokenizer and fine-tunes
   it with ``opd sft`` on ``sft.jsonl`` for ``--steps`` steps: it learns to use a hint
   when there is one, and stays weak without;
3. copies it to ``examples/demo/models/hinted_student``.

``examples/configs/context_demo.yaml`` then self-distils it: the teacher is its own
initial weights with the hint, the student sees the question alone.

Usage: ``python examples/demo/prepare_context_demo.py [--steps N]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples" / "data" / "arithmetic"
HINTS = REPO / "examples" / "data" / "arithmetic_hints"
MODELS = REPO / "examples" / "demo" / "models"
SEPARATOR = "\n\n"  # distillation.teacher_context_separator in context_demo.yaml


def column_sums_hint(problem: str) -> str:
    """``Hint: the column sums, right to left, are 16, 13, 9.`` for ``What is 347 + 589?``."""
    a, b = (int(token) for token in problem.removeprefix("What is ").removesuffix("?").split(" + "))
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    carry, sums = 0, []
    for position in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[position]) if position < len(digits_a) else 0
        y = int(digits_b[position]) if position < len(digits_b) else 0
        total = x + y + carry
        sums.append(str(total))
        carry = total // 10
    return f"Hint: the column sums, right to left, are {', '.join(sums)}."


def write_hint_data() -> None:
    """Chat-format copies of the task with the hint (see the module docstring)."""
    from opd.data.converters import load_prompt_template, math_cl_to_chat

    template = load_prompt_template(REPO / "examples" / "prompts" / "math_think_answer.txt")
    HINTS.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        rows = [json.loads(line) for line in (TASK / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        with open(HINTS / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            for row in rows:
                example = math_cl_to_chat(row, template)
                handle.write(json.dumps({"messages": example["messages"][:1], "ground_truth": example["ground_truth"],
                                         "hint": column_sums_hint(row["problem"])}) + "\n")
        if split != "train":
            continue
        with open(HINTS / "sft.jsonl", "w", encoding="utf-8") as handle:
            for index, row in enumerate(rows):
                messages = math_cl_to_chat(row, template)["messages"]
                if index % 2 == 0:  # half of the questions come with their hint
                    messages[0]["content"] = column_sums_hint(row["problem"]) + SEPARATOR + messages[0]["content"]
                handle.write(json.dumps({"messages": messages, "ground_truth": str(row["ground_truth_answer"])}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--work-dir", default=str(REPO / "results" / "context_demo_prep"))
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer

    if not (TASK / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py")], check=True)
    write_hint_data()
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "teacher")
    init_dir = work / "init"
    build_model_for_tokenizer("demo-student", tokenizer).save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    command = [
        sys.executable, "-m", "opd", "sft", "--config", str(REPO / "examples" / "configs" / "sft_arithmetic.yaml"),
        f"model.model_path={init_dir}", f"output_dir={work / 'sft'}", f"training.max_num_steps={args.steps}",
        f"data.train_path={HINTS / 'sft.jsonl'}", f"data.val_path={HINTS / 'val.jsonl'}", "data.data_format=chat",
        "training.val_freq=50", "training.save_freq=0",
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    target = MODELS / "hinted_student"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(work / "sft" / "final_model", target)
    print(f"hinted student: {target}")


if __name__ == "__main__":
    main()
