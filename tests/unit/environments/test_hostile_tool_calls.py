"""Untrusted output is data, never an exception: generated hostile tool calls against a tool episode.

240 turns, generated from a seed, are stepped through a :class:`ToolEpisode` under thread isolation: calls nested
past Python's recursion limit (in the call, in its arguments, in arguments written as a string), integer literals
of more digits than Python converts, unknown and absurd tool names, arguments of every wrong JSON type, unclosed
calls and garbage, floods of up to 40 calls in one turn, and tools that raise an exception whose message cannot be
read, return a result nested past what JSON can write, return what is not text, or echo the model's own huge
argument. 200 turns run under process isolation, where tools also misbehave as processes: they hang past the time
limit, fork children that leave the process group or are orphaned, print to both streams, end their process, and
allocate past the memory cap. Every turn must come back as a step result whose observation answers each call with
one message within the output limit (the limit plus the cut notice); under process isolation, after every turn, no
process but the idle warm workers (and the start method's own server) is left below the test's process, and nothing
a tool printed reached the test's output.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from opd_isolation_tools import (
    allocate,
    deep_result,
    echo,
    exit_process,
    leave_daemons,
    loop_forever,
    not_text,
    print_and_return,
    unprintable_error,
)

from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.tool_calls import CALL_CLOSE, CALL_OPEN, parse_tool_calls
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import Tool, ToolRegistry
from opd.rollout.tools.sandbox import SandboxLimits
from opd.rollout.tools.workers import WORKERS, _descendants

ROW = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "ground_truth": "4"}
LIMIT = 300
CUT_NOTICE = len("\n[output cut: 10000000000 characters, the limit is 300]")
NO_ARGUMENTS = {"type": "object", "properties": {}}


PROCESS_BEHAVIOURS = (loop_forever, leave_daemons, exit_process, allocate)
"""Tools that misbehave as processes: run only under process isolation, where they can be bounded."""


def _registry(isolation: str) -> ToolRegistry:
    tools = ToolRegistry([calculator_tool()])
    tools.add(Tool("echo", echo, "", {"type": "object", "properties": {"text": {}}, "required": ["text"]}))
    tools.add(Tool("print_and_return", print_and_return, "", tools.get("echo").parameters))  # type: ignore[union-attr]
    for function in (unprintable_error, deep_result, not_text, *(PROCESS_BEHAVIOURS if isolation == "process" else ())):
        tools.add(Tool(function.__name__, function, "", NO_ARGUMENTS))
    return tools


def _call(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CALL_CLOSE}'


def _hostile_call(rng: random.Random, isolation: str) -> str:
    """One call the model might write, chosen at random among the ways it can go wrong (and, in a process, the ways
    a tool can misbehave)."""
    if isolation == "process" and rng.random() < 0.25:
        return _call(rng.choice(PROCESS_BEHAVIOURS).__name__, "{}")
    kind = rng.randrange(12)
    depth = rng.choice([900, 1_000, 5_000, 100_000])
    digits = rng.choice([4_301, 10_000, 100_000])
    if kind == 0:  # the call itself nested past the recursion limit
        return f"{CALL_OPEN}{'[' * depth}{CALL_CLOSE}"
    if kind == 1:  # the arguments nested deeply, the call well formed around them
        return _call("echo", f'{{"text": {"[" * depth}{"]" * depth}}}')
    if kind == 2:  # an integer literal Python refuses to convert
        return _call("echo", f'{{"text": {"7" * digits}}}')
    if kind == 3:  # arguments as a JSON string, holding the same
        inner = rng.choice(["[" * depth, "9" * digits, "{not json"])
        return _call("echo", json.dumps(inner))
    if kind == 4:  # an unknown or absurd tool name
        return _call(rng.choice(["search", "", "x" * 100_000, "<|im_end|>", "calc\u0000ulator"]), "{}")
    if kind == 5:  # arguments of a wrong JSON type
        return _call("calculator", rng.choice(["[]", "3", "null", '"2+2"', '{"expression": 3}', '{"expression": [1]}']))
    if kind == 6:  # unclosed, or garbage inside the tags
        return rng.choice(
            [f"{CALL_OPEN}\n{{", f"{CALL_OPEN}\u00ff\ud7ff{CALL_CLOSE}", f"{CALL_OPEN}{CALL_OPEN}{CALL_CLOSE}"]
        )
    if kind == 7:  # the model's own huge argument, echoed back
        return _call("echo", json.dumps({"text": "y" * rng.choice([301, 10_000, 1_000_000])}))
    if kind == 8:
        return _call("unprintable_error", "{}")
    if kind == 9:
        return _call(rng.choice(["deep_result", "not_text"]), "{}")
    if kind == 10:  # a tool that prints to both streams (in a thread it reaches the output: only in a process)
        return _call("print_and_return" if isolation == "process" else "echo", json.dumps({"text": "x"}))
    return _call("calculator", json.dumps({"expression": rng.choice(["2+2", "9**9**9", "1/0", "(" * 10_000])}))


def hostile_turns(count: int, seed: int, isolation: str = "thread") -> list[str]:
    rng = random.Random(seed)
    turns = []
    for _ in range(count):
        calls = 1 if rng.random() < 0.8 else rng.randrange(2, 41)  # now and then a flood of calls in one turn
        turns.append("Let me check.\n" + "\n".join(_hostile_call(rng, isolation) for _ in range(calls)))
    return turns


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    WORKERS.stop_all()


def _left_below(baseline: set[int]) -> set[int]:
    """Processes below this one that were not there before the fuzz, are not idle warm workers and still run (a
    worker killed at a limit may be a zombie until the forkserver reaps it: ended, so nothing left running)."""
    return {
        pid
        for pid in set(_descendants(os.getpid())) - baseline - set(WORKERS.worker_pids())
        if _state(pid) not in ("Z", "X", "")
    }


def _state(pid: int) -> str:
    """A process's state letter from ``/proc`` ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return ""
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


@pytest.mark.parametrize(("isolation", "count"), [("thread", 240), ("process", 200)])
def test_every_hostile_turn_is_answered_within_the_limits(isolation, count, capfd):
    # A short time limit: hanging tools cost it each; memory capped below what `allocate` asks for.
    limits = SandboxLimits(timeout_s=0.3 if isolation == "process" else 5.0, max_output_chars=LIMIT,
                           isolation=isolation, max_memory_mb=512)  # fmt: skip
    environment = ToolEnvironment(_registry(isolation), limits)
    WORKERS.stop_all()
    baseline = set(_descendants(os.getpid()))  # the start method's server, if it runs already
    answered_with_errors = 0
    for index, text in enumerate(hostile_turns(count, seed=index_seed(isolation), isolation=isolation)):
        result = environment.start(ROW).step(StudentTurn(text, (), True))
        calls = parse_tool_calls(text)
        assert not result.done and len(result.observation) == len(calls) == result.tool_calls, index
        for message in result.observation:
            assert message["role"] == "tool" and isinstance(message["content"], str)
            assert len(message["content"]) <= LIMIT + CUT_NOTICE, (index, message["content"][:200])
        answered_with_errors += sum(message["content"].startswith("Error: ") for message in result.observation)
        if isolation == "process":
            # The forkserver is started by the first call: it is infrastructure, not what a call left.
            baseline |= {pid for pid in _descendants(os.getpid()) if _is_forkserver(pid)}
            left = _left_below(baseline)
            assert not left, (index, [_command(pid) for pid in left], text[:300])
    assert answered_with_errors > count  # the generator does produce failures, many of them
    assert "LEAKED" not in "".join(capfd.readouterr()), "a tool's print reached the run's output"


def _command(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:  # ended meanwhile
        return b""


def _is_forkserver(pid: int) -> bool:
    return b"forkserver" in _command(pid) or b"resource_tracker" in _command(pid)


def index_seed(isolation: str) -> int:
    return {"thread": 0, "process": 1}[isolation]
