"""Builds the tool demo's teacher and student from scratch (``benchmarks/tool_demo.py``).

1. writes the task (``examples/data/tool_multiplication``, ``examples/data/make_tool_task.py``) if missing;
2. trains a small BPE tokenizer on the task's chat text, tools block included (digits stay
   single tokens; the tools block, about 700 bytes, becomes about 165 tokens);
3. initialises the teacher (the ``student`` preset: 2 layers, hidden 64): two layers,
   because copying the operands and the calculator's result takes an induction head; no
   wider, because every sequence carries the tools block and the demo runs on one shared
   CPU core;
4. fine-tunes it with ``opd sft`` (``examples/configs/sft_tool.yaml``) on the recorded tool
   trajectories (one row per assistant turn) in ``--teacher-steps`` stages, each starting
   from the previous stage's model with a fresh optimizer and warm-up, the last at a
   quarter of the rate. It learns the call's
   format first; copying the operands, then the calculator's 7-digit result, comes in long
   plateaus (the first stage alone calls the calculator with wrong operands);
5. makes the student: the teacher fine-tuned ``--student-steps`` more on direct answers
   (``\\boxed{N}`` at once, without a call). It loses the habit (it never calls the
   calculator, and cannot multiply in its head), and keeps the rest of the teacher's weights.
   A student that must also learn to copy 7-digit numbers from scratch would need the
   teacher's thousands of steps, beyond a CPU demo's budget;
6. copies the two final models to ``examples/demo/models/{tool_teacher,tool_student}``.

Usage: ``python examples/demo/prepare_tool_models.py [--teacher-steps N ...] [--student-steps N]``
(12.5 minutes on one quiet core; a rebuild gives the committed weights bit for bit).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tool_multiplication"
MODELS = REPO / "examples" / "demo" / "models"
SFT_CONFIG = REPO / "examples" / "configs" / "sft_tool.yaml"
POLISH_RATE = 5.0e-4
"""The learning rate of the teacher's last stage (the others: sft_tool.yaml's 2e-3)."""
TEACHER_PRESET = "student"
"""The teacher's tiny preset (:data:`opd.models.tiny.TINY_PRESETS`); the student starts from the teacher."""


def ensure_task() -> None:
    """Writes the task (deterministic, a few seconds) if it is not there yet."""
    names = ("train.jsonl", "test.jsonl", "teacher_sft.jsonl", "student_sft.jsonl")
    if not all((DATA / name).is_file() for name in names):
        subprocess.run([sys.executable, str(REPO / "examples" / "data" / "make_tool_task.py")], check=True)


def chat_texts(limit: int) -> list[str]:
    """The teacher's SFT conversations rendered as ChatML text (the tokenizer's training corpus)."""
    texts = []
    with open(DATA / "teacher_sft.jsonl", encoding="utf-8") as handle:
        for line, _ in zip(handle, range(limit)):
            messages = json.loads(line)["messages"]
            texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages))
    return texts


def run_sft(init_dir: Path, output_dir: Path, train_path: Path, steps: int, *extra: str) -> Path:
    """Fine-tunes ``init_dir`` on ``train_path`` with ``opd sft``; returns the final model directory."""
    command = [
        sys.executable,
        "-m",
        "opd",
        "sft",
        "--config",
        str(SFT_CONFIG),
        f"model.model_path={init_dir}",
        f"output_dir={output_dir}",
        f"data.train_path={train_path}",
        f"training.max_num_steps={steps}",
        *extra,
    ]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    return output_dir / "final_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--teacher-steps", type=int, nargs="+", default=[600, 1500, 1200, 1000], help="steps of each stage"
    )
    parser.add_argument("--student-steps", type=int, default=20)
    parser.add_argument("--work-dir", default=str(REPO / "results" / "tool_demo_prep"))
    args = parser.parse_args()

    from opd.models.tiny import build_model_for_tokenizer, train_bpe_tokenizer

    ensure_task()
    work = Path(args.work_dir)
    if work.exists():
        shutil.rmtree(work)  # a fresh build every time: nothing here is resumed
    tokenizer = train_bpe_tokenizer(chat_texts(limit=4000), vocab_size=1024)
    model = work / "teacher_init"
    build_model_for_tokenizer(TEACHER_PRESET, tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    for stage, steps in enumerate(args.teacher_steps, start=1):
        # The last stage polishes at a quarter of the rate: at the full rate the loss stalls near 0.09.
        rate = [f"training.learning_rate={POLISH_RATE}"] if stage == len(args.teacher_steps) > 1 else []
        model = run_sft(model, work / f"sft_teacher_{stage}", DATA / "teacher_sft.jsonl", steps, *rate)
    finals = {"teacher": model}
    finals["student"] = run_sft(model, work / "sft_student", DATA / "student_sft.jsonl", args.student_steps)
    for role, final in finals.items():
        target = MODELS / f"tool_{role}"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(final, target)
        print(f"tool_{role}: {target}")


if __name__ == "__main__":
    main()
