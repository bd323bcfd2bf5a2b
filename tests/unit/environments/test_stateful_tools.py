"""Stateful tools: one worker process per episode and tool, kept between its calls, ended with the episode.

The ``python`` tool keeps an episode's variables across turns; two episodes that would read each other's
variables do not; the calls of one turn run in order; the sandbox's limits hold (time, memory, output), a killed
session says its state is lost and starts afresh; and no process outlives its episode.
"""

from __future__ import annotations

import json

import pytest
from opd_isolation_tools import is_running

from opd.rollout.environments.base import StudentTurn
from opd.rollout.environments.tool_environment import ToolEnvironment, ToolEpisode
from opd.rollout.tools.python_tool import python_tool, run_python
from opd.rollout.tools.registry import ToolRegistry
from opd.rollout.tools.sandbox import SandboxLimits
from opd.rollout.tools.workers import WORKERS

LIMITS = SandboxLimits(timeout_s=5.0, max_output_chars=400, max_memory_mb=1024)


def _turn(*codes: str) -> StudentTurn:
    calls = "".join(
        f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>" for code in codes
    )
    return StudentTurn(calls, (1, 2), ended=True)


def _answers(episode: ToolEpisode, *codes: str) -> list[str]:
    return [message["content"] for message in episode.step(_turn(*codes)).observation]


@pytest.fixture
def environment():
    yield ToolEnvironment(ToolRegistry([python_tool()]), LIMITS)
    WORKERS.stop_all()


def test_run_python_prints_and_shows_the_last_value_as_a_notebook_cell():
    assert run_python("x = 2\nprint('x is', x)\nx * 21") == "x is 2\n42\n"
    assert run_python("y = 1") == "(no output)"
    with pytest.raises(Exception, match=r"partial\nZeroDivisionError: division by zero \(line 2\)"):
        run_python("print('partial')\n1 / 0")
    with pytest.raises(Exception, match="SyntaxError"):
        run_python("def (")


def test_an_episode_keeps_its_variables_and_another_episode_cannot_read_them(environment):
    first, second = environment.start({}), environment.start({})
    assert _answers(first, "secret = 41") == ["(no output)"]
    assert _answers(second, "secret = 'other'") == ["(no output)"]
    assert _answers(first, "secret + 1") == ["42\n"]  # a later turn of the same episode sees it
    assert _answers(second, "secret") == ["'other'\n"]
    assert [len(first.workers.pids()), len(second.workers.pids())] == [1, 1]
    assert first.workers.pids() != second.workers.pids()
    third = environment.start({})
    assert "NameError: name 'secret' is not defined" in _answers(third, "secret")[0]
    for episode in (first, second, third):
        episode.close()


def test_the_calls_of_one_turn_run_in_order_in_the_episode_session(environment):
    episode = environment.start({})
    codes = [f"steps = globals().get('steps', []) + [{index}]\nsteps" for index in range(6)]
    assert _answers(episode, *codes) == [f"{list(range(index + 1))}\n" for index in range(6)]
    episode.close()


def test_a_session_killed_at_its_limit_says_its_state_is_lost_and_starts_afresh():
    environment = ToolEnvironment(ToolRegistry([python_tool()]), SandboxLimits(timeout_s=0.5, max_memory_mb=1024))
    episode = environment.start({})
    _answers(episode, "kept = 1")
    (pid,) = episode.workers.pids()
    hung = _answers(episode, "import time\ntime.sleep(30)")[0]
    assert hung.startswith("Error: python did not finish within 0.5 s") and "Its state is lost" in hung
    assert not is_running(pid)
    again = _answers(episode, "'kept' in globals()")[0]
    assert again == "(its earlier state was lost) False\n"
    assert _answers(episode, "'kept' in globals()") == ["False\n"]  # said once
    episode.close()


def test_memory_and_output_limits_hold_for_the_session(environment):
    episode = environment.start({})
    hungry = _answers(episode, "block = bytearray(4 * 2**30)")[0]
    assert hungry.startswith("Error: python failed: ") and "MemoryError" in hungry
    long = _answers(episode, "print('y' * 5000)")[0]
    assert len(long) < LIMITS.max_output_chars + 100 and "[output cut: 5001 characters" in long
    assert _answers(episode, "import os\nos._exit(4)")[0].startswith("Error: python ended its process (exit code 4)")
    episode.close()


def test_no_session_outlives_its_episode(environment):
    episodes = [environment.start({}) for _ in range(3)]
    for episode in episodes:
        child = int(_answers(episode, "import subprocess\nchild = subprocess.Popen(['sleep', '60'])\nchild.pid")[0])
        assert not is_running(child)  # what a call starts ends with the call, in a session too
    pids = [pid for episode in episodes for pid in episode.workers.pids()]
    assert len(pids) == 3 and all(is_running(pid) for pid in pids)
    ended = episodes[0].step(StudentTurn("no call: the final answer", (1,), ended=True))
    assert ended.done and episodes[0].workers.pids() == [] and not is_running(pids[0])
    episodes[1].stop()  # ended by max_episode_tokens
    assert not is_running(pids[1])
    episodes[2].close()
    episodes[2].close()  # closing twice is allowed
    assert not any(is_running(pid) for pid in pids)
