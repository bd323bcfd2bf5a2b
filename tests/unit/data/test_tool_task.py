"""The tool demo's task generator (examples/data/make_tool_task.py): disjoint splits, well-formed recorded episodes.

Not a learning test: it checks that what the demo's models are fine-tuned on is what a
run with the calculator would see and do.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from opd.data.episodes import encode_episode, split_at_first_assistant
from opd.data.sequences import render_chat
from opd.models.tiny import build_tiny_tokenizer
from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.tool_calls import MalformedCall, parse_tool_calls
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import ToolRegistry

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "data" / "make_tool_task.py"
SIZES = {"train": 40, "val": 10, "test": 20}
FILES = ("train", "val", "test", "train_episodes", "teacher_sft", "student_sft")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, list[dict]]:
    out_dir = tmp_path_factory.mktemp("tool_task")
    spec = importlib.util.spec_from_file_location("make_tool_task", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = sys.argv
    sys.argv = [
        str(SCRIPT),
        "--out-dir",
        str(out_dir),
        "--train-size",
        str(SIZES["train"]),
        "--val-size",
        str(SIZES["val"]),
        "--test-size",
        str(SIZES["test"]),
    ]
    try:  # in this process: a subprocess would import torch and transformers again
        script.main()
    finally:
        sys.argv = argv
    return {name: read(out_dir / f"{name}.jsonl") for name in FILES}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_splits_are_disjoint_products_of_a_4_and_a_3_digit_number(task):
    problems = {split: {row["problem"] for row in task[split]} for split in SIZES}
    assert {split: len(rows) for split, rows in problems.items()} == SIZES
    assert not (
        problems["train"] & problems["val"]
        or problems["train"] & problems["test"]
        or problems["val"] & problems["test"]
    )
    for split in SIZES:
        for row in task[split]:
            left, right = row["problem"].removeprefix("What is ").removesuffix("?").split(" * ")
            assert len(left) == 4 and len(right) == 3
            assert row["ground_truth_answer"] == str(int(left) * int(right))


def test_recorded_episode_runs_in_the_environment_to_the_ground_truth(task, tokenizer):
    """The recorded call parses, the calculator answers the ground truth, and the recorded answer earns reward 1."""
    environment = ToolEnvironment(ToolRegistry([calculator_tool()]))
    for problem, episode in zip(task["train"], task["train_episodes"]):
        messages = episode["messages"]
        assert [message["role"] for message in messages] == ["user", "assistant", "tool", "assistant"]
        assert problem["problem"] in messages[0]["content"]
        assert episode["ground_truth"] == problem["ground_truth_answer"]
        (call,) = parse_tool_calls(messages[1]["content"])
        assert not isinstance(call, MalformedCall) and call.name == "calculator"
        running = environment.start({"ground_truth": episode["ground_truth"]})
        step = running.step(StudentTurn(messages[1]["content"], (), True))
        assert (step.done, step.well_formed_calls, step.successful_calls) == (False, 1, 1)
        assert step.observation == [{"role": "tool", "content": episode["ground_truth"]}] == [messages[2]]
        final = running.step(StudentTurn(messages[3]["content"], (), True))
        assert final.done and final.reward == 1.0 and final.tool_calls == 0


def test_episode_encoder_reads_the_recorded_episodes(task, tokenizer):
    """The λ < 1 reader takes each episode; the loss mask covers exactly the two assistant turns."""
    tools = [calculator_tool().schema()]
    for episode in task["train_episodes"][:8]:
        prompt, rest = split_at_first_assistant(episode["messages"])
        ids, mask = encode_episode(tokenizer, prompt, rest, tools)
        learned = tokenizer.decode([token for token, on in zip(ids, mask) if on])
        assert learned == f"{rest[0]['content']}<|im_end|>{rest[2]['content']}<|im_end|>"


def test_sft_rows_render_the_environment_prompt_and_the_recorded_turns(task, tokenizer):
    """An SFT row's system turn renders, byte for byte, the prompt a run with the calculator renders."""
    tools = [calculator_tool().schema()]
    for episode, teacher_rows, student_row in zip(
        task["train_episodes"], zip(task["teacher_sft"][::2], task["teacher_sft"][1::2]), task["student_sft"]
    ):
        user = episode["messages"][0]
        with_tools = render_chat(tokenizer, [user], add_generation_prompt=True, tools=tools)
        for row in (*teacher_rows, student_row):
            assert row["messages"][1] == user and row["messages"][0]["role"] == "system"
            assert render_chat(tokenizer, row["messages"][:2], add_generation_prompt=True) == with_tools
        assert [row["messages"][2:] for row in teacher_rows] == [episode["messages"][1:2], episode["messages"][1:]]
        assert student_row["messages"][2] == {"role": "assistant", "content": f"\\boxed{{{episode['ground_truth']}}}"}
        assert not parse_tool_calls(student_row["messages"][2]["content"])
