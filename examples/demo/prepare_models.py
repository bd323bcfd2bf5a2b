"""Builds the CPU demo's teacher and student from scratch (one command, deterministic).

1. writes the arithmetic task (``examples/data/arithmetic/{train,val,test}.jsonl``) if missing;
2. trains a small BPE tokenizer on the task's chat text (digits stay single tokens);
3. initialises a tiny Qwen2 teacher (4 layers, hidden 128, intermediate 512) and a smaller
   student (2 layers, hidden 128, intermediate 256) for that tokenizer; both have heads of
   32 dimensions, the smallest vLLM's CPU attention takes;
4. fine-tunes both with ``opd sft`` (``examples/configs/sft_arithmetic.yaml``: batch 32,
   AdamW 2e-3, constant after 100 warm-up steps) on the worked solutions: the teacher for
   1500 steps, long enough to be accurate; the student for 300, so it writes the trace and
   the answer tags but gets the sums wrong;
5. copies the two final models to ``examples/demo/models/{teacher,student}``.

Usage: ``python examples/demo/prepare_models.py [--teacher-steps N] [--student-steps N]
[--only student]`` (about 17 minutes on 2 CPU cores, almost all of it the teacher; the
result is bit-identical to the committed models). ``--only student`` rebuilds the student
alone, with the tokenizer saved beside the committed teacher.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "arithmetic"
MODELS = REPO / "examples" / "demo" / "models"


def chat_texts(limit: int) -> list[str]:
    """The task's training conversations rendered as ChatML text (tokenizer training corpus)."""
    from opd.data.converters import load_prompt_template, math_cl_to_chat

    template = load_prompt_template(REPO / "examples" / "prompts" / "math_think_answer.txt")
    texts = []
    with open(DATA / "train.jsonl", encoding="utf-8") as handle:
        for line, _ in zip(handle, range(limit)):
            example = math_cl_to_chat(json.loads(line), template)
            texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in example["messages"]))
    return texts


def run_sft(init_dir: Path, output_dir: Path, steps: int, extra: list[str]) -> Path:
    """Fine-tunes ``init_dir`` with ``opd sft`` and returns its final model directory."""
    command = [
        sys.executable, "-m", "opd", "sft", "--config", str(REPO / "examples" / "configs" / "sft_arithmetic.yaml"),
        f"model.model_path={init_dir}", f"output_dir={output_dir}", f"training.max_num_steps={steps}", *extra,
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return output_dir / "final_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=1500)
    parser.add_argument("--student-steps", type=int, default=300)
    parser.add_argument("--work-dir", default=str(REPO / "results" / "demo_prep"))
    parser.add_argument("--only", choices=["teacher", "student"], default=None,
                        help="rebuild one model and keep the other (the tokenizer is read from the kept one)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer

    if not (DATA / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_arithmetic_task.py")], check=True)
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)  # a fresh build every time: nothing here is resumed
    roles = [args.only] if args.only else ["teacher", "student"]
    if args.only:
        # The kept model's tokenizer: both models must share it token for token.
        kept = "student" if args.only == "teacher" else "teacher"
        tokenizer = AutoTokenizer.from_pretrained(MODELS / kept)
    else:
        tokenizer = train_bpe_tokenizer(chat_texts(limit=5000), vocab_size=1024)
    for role in roles:
        init_dir = work / f"{role}_init"
        build_model_for_tokenizer(f"demo-{role}", tokenizer).save_pretrained(init_dir)
        tokenizer.save_pretrained(init_dir)
    finals = {}
    if "teacher" in roles:
        finals["teacher"] = run_sft(work / "teacher_init", work / "sft_teacher", args.teacher_steps, [])
    if "student" in roles:
        finals["student"] = run_sft(work / "student_init", work / "sft_student", args.student_steps,
                                    ["training.val_freq=50", "training.save_freq=0"])
    for role, final in finals.items():
        target = MODELS / role
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(final, target)
        print(f"{role}: {target}")


if __name__ == "__main__":
    main()
