"""Tool isolation (``environment.tool_isolation``): the same failure modes in a thread and in a worker process.

In a process, a tool that never returns is killed at the time limit (its worker is gone
afterwards), a tool that ends its process becomes an error observation and the next call
starts a fresh worker, memory is capped, and a tool that cannot be sent by name is a
setup error naming the tool.
"""

from __future__ import annotations

import os
import time

import pytest
from opd_isolation_tools import (
    allocate,
    big,
    exit_process,
    fail,
    is_running,
    leave,
    loop_forever,
    not_text,
    process_id,
    start_child_and_loop,
    structured,
)

from opd.rollout.environments.config import EnvironmentConfig, build_environment
from opd.rollout.tools.calculator import calculator_tool
from opd.rollout.tools.registry import Tool
from opd.rollout.tools.sandbox import SandboxLimits, run_tool
from opd.rollout.tools.workers import WORKERS

NO_ARGUMENTS = {"type": "object", "properties": {}}


def _tool(function, parameters=NO_ARGUMENTS) -> Tool:
    return Tool(function.__name__, function, "", parameters)


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    WORKERS.stop_all()


def _run(function, isolation, arguments=None, **limits):
    parameters = {"type": "object", "properties": {"reason": {"type": "string"}}} if function is fail else NO_ARGUMENTS
    settings = {"timeout_s": 2.0, "max_output_chars": 100, "isolation": isolation, **limits}
    return run_tool(_tool(function, parameters), function.__name__, arguments or {}, SandboxLimits(**settings))


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize(
    ("function", "arguments", "expected", "ok"),
    [
        (fail, {"reason": "disk full"}, "Error: fail failed: RuntimeError: disk full", False),
        (leave, None, "Error: leave failed: SystemExit: 1", False),
        (fail, {"reason": 3}, "Error: fail: arguments['reason']: 3 is not of type 'string'", False),
        (not_text, None, "Error: not_text failed: TypeError: Object of type object is not JSON serializable", False),
        (big, None, "x" * 100 + "\n[output cut: 500 characters, the limit is 100]", True),
        (structured, None, '{"total": 3}', True),
    ],
)
def test_each_failure_is_an_error_observation_in_either_isolation(isolation, function, arguments, expected, ok):
    outcome = _run(function, isolation, arguments)
    assert outcome.content.startswith(expected) and outcome.ok is ok, outcome.content


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_unknown_tool_and_a_timeout_are_observations(isolation):
    limits = SandboxLimits(timeout_s=0.3, isolation=isolation)
    assert run_tool(None, "search", {}, limits).content == "Error: there is no tool named 'search'"
    outcome = run_tool(_tool(loop_forever), "loop_forever", {}, limits)
    assert (outcome.content, outcome.ok) == ("Error: loop_forever did not finish within 0.3 s", False)


def test_a_runaway_tool_is_killed_at_the_limit_and_the_next_call_works():
    WORKERS.stop_all()
    first = int(_run(process_id, "process").content)
    assert WORKERS.worker_pids() == [first]  # warm: back in the pool
    assert _run(process_id, "process").content == str(first)  # reused
    assert _run(loop_forever, "process", timeout_s=0.3).content == "Error: loop_forever did not finish within 0.3 s"
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # killed and reaped: no such process
    assert WORKERS.worker_pids() == []
    assert int(_run(process_id, "process").content) != first


def test_a_tool_that_ends_its_process_is_an_observation_and_the_next_call_works():
    WORKERS.stop_all()
    outcome = _run(exit_process, "process")
    assert (outcome.content, outcome.ok) == ("Error: exit_process ended its process (exit code 3)", False)
    assert WORKERS.worker_pids() == []
    assert _run(structured, "process").content == '{"total": 3}'


def test_a_worker_s_memory_is_capped():
    outcome = _run(allocate, "process", max_memory_mb=512)
    assert (outcome.content, outcome.ok) == ("Error: allocate failed: MemoryError", False)
    assert _run(structured, "process", max_memory_mb=512).ok  # the same worker answers on


def test_a_tool_not_importable_by_name_is_a_setup_error_in_a_process():
    anonymous = Tool("anonymous", lambda: "hi", "", NO_ARGUMENTS)
    assert run_tool(anonymous, "anonymous", {}, SandboxLimits(isolation="thread")).content == "hi"
    for isolation in ("process", "auto"):  # auto: a tool not declared thread_safe runs in a process
        with pytest.raises(
            ValueError,
            match=rf"tool .anonymous. cannot run in a worker process \(environment\.tool_isolation = {isolation}\)",
        ):
            run_tool(anonymous, "anonymous", {}, SandboxLimits(isolation=isolation))


def test_the_config_runs_the_built_in_tools_in_a_process():
    environment = build_environment(EnvironmentConfig(tool_isolation="process"))
    assert environment.limits.isolation == "process"
    outcome = run_tool(calculator_tool(), "calculator", {"expression": "1234 * 567"}, environment.limits)
    assert (outcome.content, outcome.ok) == ("699678", True)
    with pytest.raises(ValueError, match="isolation"):
        SandboxLimits(isolation="container")


def test_a_function_the_worker_cannot_import_is_a_setup_error():
    import opd_isolation_tools

    def nested() -> str:  # pickled by name as opd_isolation_tools.ghost, which the worker does not have
        return "never"

    nested.__qualname__ = nested.__name__ = "ghost"
    nested.__module__ = opd_isolation_tools.__name__
    opd_isolation_tools.ghost = nested  # picklable here, by that name
    try:
        with pytest.raises(ValueError, match="the worker could not import its function"):
            run_tool(_tool(nested), "ghost", {}, SandboxLimits(isolation="process"))
    finally:
        del opd_isolation_tools.ghost
    assert _run(structured, "process").ok  # the worker answers on


def test_an_idle_worker_killed_from_outside_is_replaced():
    import signal

    WORKERS.stop_all()
    first = int(_run(process_id, "process").content)
    os.kill(first, signal.SIGKILL)
    for _ in range(500):  # until the kill has landed (the pool sees it as not alive)
        if not WORKERS._idle[0].process.is_alive():
            break
        time.sleep(0.01)
    second = int(_run(process_id, "process").content)
    assert second != first and WORKERS.worker_pids() == [second]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_what_a_runaway_tool_started_is_killed_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    parameters = {"type": "object", "properties": {"pid_file": {"type": "string"}}}
    limits = SandboxLimits(timeout_s=1.0, isolation="process")
    outcome = run_tool(
        Tool("spawner", start_child_and_loop, "", parameters), "spawner", {"pid_file": str(pid_file)}, limits
    )
    assert outcome.content == "Error: spawner did not finish within 1 s"
    child = int(pid_file.read_text())
    for _ in range(500):  # SIGKILL lands asynchronously
        if not is_running(child):
            break
        time.sleep(0.01)
    assert not is_running(child)


def test_the_kill_looks_again_until_nothing_below_runs(monkeypatch):
    """A process killed in the middle of a fork runs on until it is next scheduled (on busy cores, for longer than
    any fixed number of quick looks), and its new child appears only then, re-parented to the worker. Simulated:
    the forking process is still running for 25 looks after the kill; then it has ended and its child runs. The kill
    must reach the child, and must not return while anything it killed still runs."""
    import signal

    from opd.rollout.tools import workers

    forker, child = 1001, 1002
    looks = {"count": 0}
    killed: set[int] = set()

    def descendants(pid, running_only=False):
        assert running_only
        looks["count"] += 1
        if looks["count"] <= 25 or forker not in killed:
            return [forker]
        return [child] if child not in killed else []

    def kill(pid, signal_number):
        if signal_number == signal.SIGKILL:
            killed.add(pid)

    monkeypatch.setattr(workers, "_descendants", descendants)
    monkeypatch.setattr(workers.os, "kill", kill)
    monkeypatch.setattr(workers.time, "sleep", lambda seconds: None)
    workers.kill_descendants(4242)  # another process (a worker stopped at its limit): nothing to reap here
    assert killed == {forker, child} and looks["count"] == 27
