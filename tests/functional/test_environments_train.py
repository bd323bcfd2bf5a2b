"""Environments from the config train: declared tools, the stateful python tool, an MCP server's tool, and two
environments in one run, each a 2-step run of the tiny config.

The tiny random student never writes a tool call, so the first turn of every episode is replaced by a call to a
tool of the episode's environment (the engine is wrapped, nothing else); the environment runs it for real and the
engine writes the second turn. Each run checks what the teacher scored: the prompt lists exactly the episode's
tools, the tool's answer follows the call, the observation is a hole in the loss mask; and the episode metrics.
The two-environment run trains the sampled-token loss with a task reward: each student token's reward is its
turn's return, the per-turn reward of a failed call included.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from opd_test_helpers import REPO_ROOT, first_turn_calls_the_tool, short_run_overrides

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.utils.config import load_config

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
MCP_SERVER = REPO_ROOT / "tests" / "opd_mcp_server.py"


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# Per case: the environment section, the call the first turn makes (by the tools its prompt lists), the text the
# tool answers with, and the tools each prompt lists.
CASES = {
    "declared_tool": (
        {"tools": [{"function": "opd_config_tools:multiply"}]},
        {"multiply": (_call("multiply", {"a": 6, "b": 7}), "42")},
    ),
    "python_tool": (
        {"tools": ["python"]},
        {"python": (_call("python", {"code": "x = 6\nx * 7"}), "42\n")},
    ),
    "mcp_tool": (
        {
            "tools": [],
            "mcp_servers": [{"command": [sys.executable, str(MCP_SERVER)], "tools": ["add"], "prefix": "m_"}],
        },
        {"m_add": (_call("m_add", {"a": 40, "b": 2}), "42")},
    ),
    "two_environments": (
        {
            "members": {
                "math": {"tools": ["calculator"]},
                "code": {"tools": ["python"], "grader": "none", "failed_call_reward": -0.5},
            },
            "route_key": "task",
        },
        {
            "calculator": (_call("calculator", {"expression": "6 * 7"}), "42"),
            "python": (_call("python", {"code": "print(6 * 7)\n1 / 0"}), "Error: python failed: "),
        },
    ),
}


def _tools_listed(text: str) -> list[str]:
    return sorted(name for name in ("calculator", "multiply", "python", "m_add") if f'"name": "{name}"' in text)


def _only_tool_listed(prompt: str) -> str:
    """The one tool a prompt's system part lists."""
    (listed,) = _tools_listed(prompt.split("<|im_start|>user")[0])
    return listed


def _train_data(tmp_path: Path) -> Path:
    """The tiny training rows, every other one a "code" task (the rest have no task field: "math" by default)."""
    rows = [json.loads(line) for line in (REPO_ROOT / "examples/data/tiny_arithmetic/train.jsonl").open()][:8]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({**row, "task": "code"} if i % 2 else row) + "\n" for i, row in enumerate(rows)))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_configured_environment_trains_two_steps(tmp_path, case):
    section, calls = CASES[case]
    rewarded = case == "two_environments"
    if rewarded:
        section = {**section, "default": "math"}
    overrides = [
        *short_run_overrides(tmp_path),
        f"data.train_path={_train_data(tmp_path)}",
        "checkpointing.enabled=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=2",
        "data.shuffle=false",  # rows in file order: both environments play in the first two steps
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=6",
        *([] if rewarded else ["loss_fn.compile_kernels=false"]),
        "data.max_prompt_length=1024",
        f"environment={json.dumps({**section, 'max_turns': 2})}",
        *(["loss_fn={type: sampled_token, adv_tau: 1.0}"] if rewarded else []),
    ]
    config = load_config(MasterConfig, TINY_CONFIG, overrides)
    parts = setup(config)
    # The first turn of every episode calls the tool its prompt lists.
    first_turn_calls_the_tool(
        parts.student_generation,
        parts.tokenizer,
        lambda prompt: calls[_only_tool_listed(prompt)][0],
    )
    scored = []
    real_score = parts.teacher_policy.score

    def recording_score(batch, request):
        keys = ("input_ids", "input_lengths", "token_mask", "task_reward")
        scored.append({key: batch[key].clone() for key in keys if key in batch})
        return real_score(batch, request)

    parts.teacher_policy.score = recording_score  # type: ignore[method-assign]
    distillation_train(parts)

    seen = set()
    for batch in scored:
        for row in range(batch["input_ids"].shape[0]):
            text = parts.tokenizer.decode(batch["input_ids"][row, : int(batch["input_lengths"][row])])
            listed = _only_tool_listed(text)  # the prompt lists its environment's tool
            seen.add(listed)
            _, answer = calls[listed]
            assert f"<|im_start|>user\n<tool_response>\n{answer}" in text, "the tool's answer follows the call"
            mask = batch["token_mask"][row, : int(batch["input_lengths"][row])]
            assert int((mask[1:] != mask[:-1]).sum()) >= 2, "the observation is a hole in the mask"
            if rewarded:  # per token: the first turn's return (-0.5 for the failed python call, else the final 0)
                reward = batch["task_reward"][row, : int(batch["input_lengths"][row])]
                first_turn = mask.nonzero().flatten()
                first_turn = first_turn[first_turn < int(((mask[1:] == 0) & (mask[:-1] == 1)).nonzero()[0]) + 1]
                assert torch.all(reward[first_turn] == (-0.5 if listed == "python" else 0.0)), (listed, reward)
                assert torch.all(reward[mask == 0] == 0)
    assert seen == set(calls), "every environment played its examples"
    records = [json.loads(line) for line in (Path(config.logger.log_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if "train/on_policy" in record]
    assert len(train) == 2
    for record in train:
        assert record["env/turns"] == 2.0 and record["env/tool_calls"] == 1.0
    if rewarded:  # the code member's failing call is rewarded -0.5 on its turn
        assert all(record["env/turn_reward"] == -0.5 for record in train)
        assert all(record["train/task_reward"] < 0 for record in train)
