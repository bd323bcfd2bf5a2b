"""Limits per call, per turn and per episode, where each tool runs, and what a call leaves behind.

* ``isolation: auto`` runs a tool declared ``thread_safe`` (the calculator) on a thread of this process and any
  other tool in a worker process;
* a turn runs at most ``max_calls_per_turn`` calls, the rest answered with an error; the turn's and the episode's
  tool time (``turn_time_s``, ``episode_time_s``) bound each call by what is left, and a call that would start
  after it is spent is not run;
* calls run at once: 32 episodes, each calling a 0.2 s tool, step one turn with at most ``parallelism`` calls at
  a time (counted by the tool itself), in about 0.2 s × 32 / parallelism;
* in a process, what a call started ends with the call, also when it returned normally, also a child that left the
  process group and a grandchild orphaned by a double fork; what a tool prints never reaches the run's output;
* the calculator refuses a complex result.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from opd_isolation_tools import is_running, print_and_return, process_id, start_escaping_children
from opd_scripted_engine import ScriptedGeneration

from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_tokenizer
from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.tool_environment import ToolEnvironment
from opd.rollout.environments.turn_template import TurnTemplate
from opd.rollout.multi_turn import _step_episodes, multi_turn_rollout
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import Tool, ToolRegistry
from opd.rollout.tools.sandbox import SandboxLimits, run_tool
from opd.rollout.tools.workers import WORKERS

ROW = {"messages": [{"role": "user", "content": "?"}], "ground_truth": "4"}
NO_ARGUMENTS = {"type": "object", "properties": {}}
NAP_S = 0.2


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    WORKERS.stop_all()


class Nap:
    """A tool that sleeps, counting how many of its calls run at once."""

    def __init__(self, seconds: float = NAP_S) -> None:
        self.seconds, self.running, self.most, self.lock = seconds, 0, 0, threading.Lock()

    def __call__(self) -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        return "rested"


def _call(name: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'


def _turn(*names: str) -> StudentTurn:
    return StudentTurn("\n".join(_call(name) for name in names), (), True)


def _environment(nap: Nap, **limits) -> ToolEnvironment:
    tools = ToolRegistry([Tool("nap", nap, "", NO_ARGUMENTS, thread_safe=True)])
    return ToolEnvironment(tools, SandboxLimits(**{"timeout_s": 5.0, **limits}))


def test_auto_runs_declared_safe_tools_on_a_thread_and_others_in_a_process():
    auto = SandboxLimits()
    assert auto.isolation_of(calculator_tool()) == "thread"
    elsewhere = run_tool(Tool("process_id", process_id, "", NO_ARGUMENTS), "process_id", {}, auto)
    assert elsewhere.ok and int(elsewhere.content) != os.getpid()
    here = run_tool(
        Tool("process_id", process_id, "", NO_ARGUMENTS), "process_id", {}, SandboxLimits(isolation="thread")
    )
    assert int(here.content) == os.getpid()


def test_a_turn_runs_at_most_its_cap_of_calls():
    result = _environment(Nap(0.0), max_calls_per_turn=3).start(ROW).step(_turn(*["nap"] * 10))
    contents = [message["content"] for message in result.observation]
    assert contents[:3] == ["rested"] * 3 and result.successful_calls == 3
    assert contents[3:] == ["Error: more than 3 calls in one turn: this one was not run"] * 7


def test_the_turns_tool_time_bounds_its_calls():
    # One call at a time: 0.3 s, then 0.2 s left (the call is stopped there), then nothing left.
    environment = _environment(Nap(0.3), turn_time_s=0.5, parallelism=1)
    contents = [message["content"] for message in environment.start(ROW).step(_turn("nap", "nap", "nap")).observation]
    assert contents[0] == "rested"
    assert contents[1].startswith("Error: nap did not finish within 0.")  # what was left of the turn, under 0.3 s
    assert contents[2] == "Error: nap was not run: the tool time of this turn or episode is spent"


def test_the_episodes_tool_time_bounds_its_later_turns():
    episode = _environment(Nap(0.3), episode_time_s=0.5).start(ROW)
    turns = [[message["content"] for message in episode.step(_turn("nap")).observation] for _ in range(3)]
    assert turns[0] == ["rested"]
    assert turns[1][0].startswith("Error: nap did not finish within 0.")
    assert turns[2] == ["Error: nap was not run: the tool time of this turn or episode is spent"]


class _Running:
    """What the rollout keeps per running episode, as far as stepping it goes."""

    def __init__(self, episode) -> None:
        self.episode = episode
        self.record = type("Record", (), {"environment_seconds": 0.0})()


@pytest.mark.parametrize("parallelism", [4, 8])
def test_episodes_and_their_calls_run_at_once_up_to_the_parallelism(parallelism):
    nap = Nap()
    environment = _environment(nap, parallelism=parallelism)
    running = [_Running(environment.start(ROW)) for _ in range(32)]
    began = time.perf_counter()
    results = _step_episodes(environment, running, [_turn("nap")] * 32, last_turn=False)
    elapsed = time.perf_counter() - began
    assert [result.observation for result in results] == [[{"role": "tool", "content": "rested"}]] * 32
    assert nap.most == parallelism  # never more at once, and the bound reached
    waves = 32 // parallelism
    # Not 32 × 0.2 = 6.4 s one after another: waves of `parallelism` calls (a loose upper bound, for slow machines).
    assert waves * NAP_S <= elapsed < waves * NAP_S + 2.0


def test_the_rollouts_environment_time_is_wall_time_not_the_sum_of_its_episodes():
    nap = Nap()
    tokenizer = build_tiny_tokenizer()
    environment = _environment(nap, parallelism=8)
    rollout = multi_turn_rollout(
        ScriptedGeneration(tokenizer, [_call("nap") + "<|im_end|>", "done<|im_end|>"], (tokenizer.eos_token_id,)),
        environment,
        TurnTemplate(tokenizer, environment.tool_schemas()),
        [ROW] * 16,
        [ROW["messages"]] * 16,
        GenerateStrategyConfig(max_length=200),
        max_turns=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    summed = sum(record.environment_seconds for record in rollout.episodes)
    wall = rollout.metrics()["timing/environment"]
    assert summed >= 16 * NAP_S  # each episode waited for its own nap
    assert 2 * NAP_S <= wall < summed / 2  # two waves of 8 naps at once


@pytest.mark.skipif(
    not os.path.isdir("/proc"),
    reason="the process-tree cleanup it checks reads /proc, which only Linux has "
    "(elsewhere only the process group is killed)",
)
def test_what_a_call_started_ends_with_the_call_even_when_it_returned(tmp_path):
    pid_file = tmp_path / "children"
    tool = Tool("spawn", start_escaping_children, "", {"type": "object", "properties": {"pid_file": {}}})
    outcome = run_tool(tool, "spawn", {"pid_file": str(pid_file)}, SandboxLimits(isolation="process"))
    assert (outcome.content, outcome.ok) == ("started", True)
    children = [int(pid) for pid in pid_file.read_text().split()]
    assert len(children) == 2
    for _ in range(500):
        if not any(map(is_running, children)):
            break
        time.sleep(0.01)
    assert not any(map(is_running, children)), [pid for pid in children if is_running(pid)]
    assert WORKERS.worker_pids()  # the worker itself answers on


def test_what_a_tool_prints_is_dropped_in_a_process(capfd):
    tool = Tool("printer", print_and_return, "", {"type": "object", "properties": {"text": {"type": "string"}}})
    outcome = run_tool(tool, "printer", {"text": "hello"}, SandboxLimits(isolation="process"))
    assert (outcome.content, outcome.ok) == ("printed", True)
    captured = capfd.readouterr()
    assert "LEAKED" not in captured.out + captured.err


def test_the_calculator_refuses_a_complex_result():
    outcome = run_tool(calculator_tool(), "calculator", {"expression": "(-8)**0.5"}, SandboxLimits())
    assert (outcome.content, outcome.ok) == (
        "Error: calculator failed: CalculatorError: the result is not a real number",
        False,
    )
