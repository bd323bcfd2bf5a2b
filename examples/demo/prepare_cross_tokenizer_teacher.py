"""Builds the cross-tokenizer demo's teacher: the demo's addition teacher again, with another tokenizer.

1. trains a second byte-level BPE tokenizer with other merges and a smaller vocabulary
   (``--vocab-size``, 340) on other text (both tasks of ``arithmetic_two_tasks``), so the
   two tokenizers cut the same trace differently (e.g. ``carry`` or ``answer`` are one
   token in one and several in the other) and number some shared tokens differently;
2. initialises a model of the demo teacher's shape for it and fine-tunes it with
   ``opd sft`` on the addition task for 1500 steps, exactly like the demo teacher;
3. copies it to ``examples/demo/models/teacher_other_tokenizer``.

Usage: ``python examples/demo/prepare_cross_tokenizer_teacher.py [--steps N]`` (about 17
minutes on 2 idle CPU cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "examples" / "demo" / "models"
TEXT = REPO / "examples" / "data" / "arithmetic_two_tasks" / "train.jsonl"


def corpus(limit: int) -> list[str]:
    """Rendered conversations of both tasks (another corpus than the demo tokenizer's)."""
    from opd.data.converters import load_prompt_template, math_cl_to_chat

    template = load_prompt_template(REPO / "examples" / "prompts" / "math_think_answer.txt")
    texts = []
    with open(TEXT, encoding="utf-8") as handle:
        for line, _ in zip(handle, range(limit)):
            example = math_cl_to_chat(json.loads(line), template)
            texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in example["messages"]))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--vocab-size", type=int, default=340)
    parser.add_argument("--work-dir", default=str(REPO / "results" / "cross_tokenizer_prep"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer

    if not TEXT.is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_two_task_arithmetic.py")], check=True)
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)
    tokenizer = train_bpe_tokenizer(corpus(limit=5000), vocab_size=args.vocab_size)
    demo = AutoTokenizer.from_pretrained(MODELS / "teacher")
    shared = set(tokenizer.get_vocab()) & set(demo.get_vocab())
    print(f"tokenizer: {len(tokenizer)} tokens, {len(shared)} shared with the demo's {len(demo)}")
    init_dir = work / "teacher_init"
    build_model_for_tokenizer("demo-teacher", tokenizer).save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    command = [
        sys.executable, "-m", "opd", "sft", "--config", str(REPO / "examples" / "configs" / "sft_arithmetic.yaml"),
        f"model.model_path={init_dir}", f"output_dir={work / 'sft'}", f"training.max_num_steps={args.steps}",
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    target = MODELS / "teacher_other_tokenizer"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(work / "sft" / "final_model", target)
    print(f"teacher: {target}")


if __name__ == "__main__":
    main()
