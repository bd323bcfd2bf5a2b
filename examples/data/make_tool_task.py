"""Writes the tool demo's task: 4-digit × 3-digit multiplication, which a tiny model can only do with a calculator.

Problems are math-cl rows (``problem``, ``ground_truth_answer``), read with
``data.data_format: math_cl`` and a short prompt (``examples/prompts/tool_math.txt``:
the problem, then "Put the final answer in \\boxed{}."; the specification's long prompt
would cost about 140 more tokens per sequence on CPU); the math verifier reads the
answer from ``\\boxed{}``. Splits ``test``, ``val`` and ``train`` are disjoint (no
problem appears twice) and deterministic for a seed.

Besides the problems, it writes what the demo's models are fine-tuned on (chat rows):

* ``train_episodes.jsonl``: the teacher's recorded tool trajectories, one per training
  problem, as fixed multi-turn data (:mod:`opd.data.episodes`): the user's prompt, an
  assistant turn that calls the calculator in the template's own text
  (``<tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 357"}}</tool_call>``),
  the calculator's answer as a ``tool`` message, and the final assistant turn
  ``\\boxed{1721097}``;
* ``teacher_sft.jsonl``: the same trajectories cut into one row per assistant turn, for
  ``opd sft`` (which learns each row's last assistant message): the call, and the
  answer after the tool's result;
* ``student_sft.jsonl``: the same prompts answered directly, without a call (the
  student's starting habit; it cannot multiply in its head).

An ``opd sft`` row has no ``tools`` argument, so the SFT rows start with a ``system``
message whose text is exactly the tools block the chat template writes when given the
calculator's schema: the fine-tuned models see, byte for byte, the prompt that a run
with ``environment: {tools: [calculator]}`` renders.

Usage: ``python examples/data/make_tool_task.py [--out-dir DIR] [--train-size N] [--seed S]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

PROMPT_FILE = REPO / "examples" / "prompts" / "tool_math.txt"
DEFAULT_OUT = Path(__file__).parent / "tool_multiplication"
TOOL_NAME = "calculator"


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator, as the chat template writes a call."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "{TOOL_NAME}", "arguments": {arguments}}}\n</tool_call>'


def answer_text(value: int | str) -> str:
    """The final assistant turn: the boxed value."""
    return f"\\boxed{{{value}}}"


def tools_system_text() -> str:
    """The text of the system turn that the tiny chat template writes for the calculator's schema."""
    from opd.models.tiny import build_tiny_tokenizer
    from opd.rollout.tools.calculator import calculator_tool

    tokenizer = build_tiny_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tools=[calculator_tool().schema()], tokenize=False
    )
    head, end = "<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\n"
    if not rendered.startswith(head) or end not in rendered:
        raise SystemExit("make_tool_task: the chat template does not write the tools in a system turn")
    return rendered[len(head) : rendered.index(end)]


def make_problems(count: int, rng: random.Random, seen: set[tuple[int, int]]) -> list[dict[str, Any]]:
    """``count`` new problems ``a * b`` with a 4-digit ``a`` and a 3-digit ``b``, none already in ``seen``."""
    rows = []
    while len(rows) < count:
        a, b = rng.randint(1000, 9999), rng.randint(100, 999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"problem": f"What is {a} * {b}?", "ground_truth_answer": str(a * b)})
    return rows


def operands(problem: str) -> tuple[int, int]:
    """``(a, b)`` of ``What is a * b?``."""
    left, right = problem.removeprefix("What is ").removesuffix("?").split(" * ")
    return int(left), int(right)


def recorded_episode(row: dict[str, Any], prompt_template: str) -> dict[str, Any]:
    """The teacher's trajectory on ``row``: call, the calculator's result, answer (a chat row)."""
    from opd.rollout.tools.calculator import calculate

    a, b = operands(row["problem"])
    expression = f"{a} * {b}"
    result = calculate(expression)  # what the environment's calculator answers
    return {
        "messages": [
            {"role": "user", "content": prompt_template.format(prompt=row["problem"])},
            {"role": "assistant", "content": tool_call_text(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": answer_text(result)},
        ],
        "ground_truth": row["ground_truth_answer"],
    }


def sft_rows(episode: dict[str, Any], system_text: str, with_tool: bool) -> list[dict[str, Any]]:
    """``opd sft`` rows of an episode: one per assistant turn (``with_tool``), or the direct answer alone."""
    system = {"role": "system", "content": system_text}
    messages = episode["messages"]
    if not with_tool:
        answer = {"role": "assistant", "content": answer_text(episode["ground_truth"])}
        return [{"messages": [system, messages[0], answer], "ground_truth": episode["ground_truth"]}]
    return [
        {"messages": [system, *messages[: end + 1]], "ground_truth": episode["ground_truth"]}
        for end, message in enumerate(messages)
        if message["role"] == "assistant"
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Writes ``rows`` whole under a private name, then renames (a reader never sees half a file)."""
    staging = path.parent / f".{path.name}.{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(staging, path)
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT))
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--test-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from opd.data.converters import load_prompt_template

    prompt_template = load_prompt_template(PROMPT_FILE)
    system_text = tools_system_text()
    rng = random.Random(args.seed)
    seen: set[tuple[int, int]] = set()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Test and validation first, so their problems are fixed whatever the train size.
    for name, size in (("test", args.test_size), ("val", args.val_size), ("train", args.train_size)):
        problems = make_problems(size, rng, seen)
        write_jsonl(out_dir / f"{name}.jsonl", problems)
        if name == "train":
            episodes = [recorded_episode(row, prompt_template) for row in problems]
            write_jsonl(out_dir / "train_episodes.jsonl", episodes)
            write_jsonl(
                out_dir / "teacher_sft.jsonl",
                [row for episode in episodes for row in sft_rows(episode, system_text, True)],
            )
            write_jsonl(
                out_dir / "student_sft.jsonl",
                [row for episode in episodes for row in sft_rows(episode, system_text, False)],
            )


if __name__ == "__main__":
    main()
