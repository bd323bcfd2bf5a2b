"""Tools from an MCP server, through the official SDK, against the local stdio server in tests/opd_mcp_server.py.

One server is started per module (the ``tools`` fixture); the tests that end or close a server say so.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from opd_isolation_tools import is_running
from pydantic import ValidationError

pytest.importorskip("mcp")

from opd.rollout.tools.mcp_tools import (
    INSTALL_HINT,
    McpClient,
    McpServerConfig,
    McpServerError,
    mcp_client,
    mcp_tools,
    tool_from_listing,
)
from opd.rollout.tools.registry import Tool
from opd.rollout.tools.sandbox import SandboxLimits, run_tool

SERVER = str(Path(__file__).resolve().parents[2] / "opd_mcp_server.py")
LIMITS = SandboxLimits(timeout_s=5.0, max_output_chars=200)


def server_config(**overrides) -> McpServerConfig:
    return McpServerConfig(**{"command": [sys.executable, SERVER], "timeout_s": 10.0, **overrides})


def run(tool: Tool, limits: SandboxLimits = LIMITS, **arguments):
    return run_tool(tool, tool.name, arguments, limits)


def ended_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def tools():
    config = server_config()
    yield {tool.name: tool for tool in mcp_tools(config)}
    mcp_client(config).close()


def test_lists_the_servers_tools_with_their_schemas(tools):
    assert set(tools) == {"add", "echo", "fail", "slow", "pid", "environment", "picture"}
    add = tools["add"]
    assert add.description == "Adds two integers."
    assert add.parameters["type"] == "object"
    assert {key: value["type"] for key, value in add.parameters["properties"].items()} == {
        "a": "integer",
        "b": "integer",
    }
    assert sorted(add.parameters["required"]) == ["a", "b"]
    assert add.schema()["function"]["name"] == "add"
    assert all(tool.thread_safe for tool in tools.values())


def test_calls_through_the_sandbox_give_the_tools_text(tools):
    assert run(tools["add"], a=2, b=3).content == "5"
    echoed = run(tools["echo"], text="héllo <b>")
    assert (echoed.content, echoed.ok) == ("héllo <b>", True)
    assert run(tools["picture"]).content == "a pixel\n[image: image/png]"  # a non-text part is named
    long = run(tools["echo"], text="x" * 500)
    assert long.ok and long.content.startswith("x" * 200 + "\n[output cut: 500 characters")


def test_a_tool_that_raises_gives_an_error_observation(tools):
    outcome = run(tools["fail"], reason="boom")
    assert not outcome.ok
    assert outcome.content.startswith("Error: fail failed: McpToolError: Error executing tool fail")


def test_a_slow_tool_gives_the_timeout_observation_within_the_limit(tools):
    started = time.monotonic()
    outcome = run(tools["slow"], SandboxLimits(timeout_s=0.3), seconds=3.0)
    assert outcome == type(outcome)("Error: slow did not finish within 0.3 s", False)
    assert time.monotonic() - started < 1.5
    started = time.monotonic()
    assert run(tools["add"], a=1, b=1).content == "2"  # the abandoned call holds up nothing
    assert time.monotonic() - started < 1.5


def test_the_configs_own_timeout_bounds_a_call_the_sandbox_waits_longer_for(tools):
    (slow,) = mcp_tools(server_config(timeout_s=0.3, tools=["slow"]))  # the same server: only the timeout differs
    started = time.monotonic()
    outcome = run(slow, seconds=3.0)
    assert not outcome.ok
    assert outcome.content.startswith("Error: slow failed: TimeoutError: slow: the MCP server")
    assert "did not answer within 0.3 s" in outcome.content
    assert time.monotonic() - started < 1.5


def test_arguments_that_break_the_schema_are_refused_before_the_call(tools):
    assert run(tools["add"], a="2", b=3).content == "Error: add: arguments['a']: '2' is not of type 'integer'"
    assert run(tools["add"], a=2).content == "Error: add: arguments: 'b' is a required property"
    assert run_tool(None, "subtract", {}, LIMITS).content == "Error: there is no tool named 'subtract'"


def test_prefix_and_tools_choose_and_name_what_the_student_sees(tools):
    config = server_config(prefix="calc.", tools=["echo", "add"])
    chosen = mcp_tools(config)
    assert [tool.name for tool in chosen] == ["calc.echo", "calc.add"]
    assert run(chosen[1], a=4, b=5).content == "9"
    assert mcp_client(config) is mcp_client(server_config())  # one server for both
    with pytest.raises(ValueError, match="has no tool 'subtract'; it has 'add', "):
        mcp_tools(server_config(tools=["add", "subtract"]))


def test_a_server_tool_with_an_unusable_name_or_schema_is_skipped_with_a_warning(caplog):
    config = server_config()
    unusable = [
        {"name": "bad_schema", "inputSchema": {"type": "object", "properties": {"x": {"type": 12}}}},
        {"name": "not_an_object", "inputSchema": {"type": "array"}},
        {"name": "no_schema"},
        {"name": "has space", "inputSchema": {"type": "object"}},
    ]
    with caplog.at_level(logging.WARNING, logger="opd"):
        assert [tool_from_listing(entry, config) for entry in unusable] == [None] * 4
    for entry in unusable:
        assert f"tool {entry['name']!r} is skipped" in caplog.text
    usable = tool_from_listing({"name": "ok", "title": "Fine", "inputSchema": {"type": "object"}}, config)
    assert usable is not None and (usable.name, usable.description) == ("ok", "Fine")


def test_a_server_killed_mid_run_gives_an_error_observation_then_starts_again(tools):
    client = mcp_client(server_config())
    first = int(run(tools["pid"]).content)
    starts = client.starts
    outcomes = []
    waiting = threading.Thread(target=lambda: outcomes.append(run(tools["slow"], seconds=5.0)))
    waiting.start()
    time.sleep(0.3)  # the call is on the server
    os.kill(first, signal.SIGKILL)
    waiting.join(3.0)
    (outcome,) = outcomes
    assert not outcome.ok
    assert outcome.content.startswith("Error: slow failed: McpServerError: slow: the MCP server")
    assert "ended" in outcome.content

    second = int(run(tools["pid"]).content)  # the next call starts the server again
    assert second != first and not is_running(first)
    assert client.server_pid == second
    os.kill(second, signal.SIGKILL)  # ended while idle: the next call does not even fail
    assert ended_within(second, 2.0)
    assert run(tools["add"], a=1, b=2) == type(outcome)("3", True)
    assert client.starts == starts + 2


def test_under_process_isolation_each_call_has_a_server_of_its_own(tools):
    limits = SandboxLimits(timeout_s=10.0, isolation="process")
    pids = [int(run(tools["pid"], limits).content) for _ in range(2)]  # the function pickles by value
    assert len(set(pids)) == 2 and mcp_client(server_config()).server_pid not in pids
    assert not any(is_running(pid) for pid in pids)  # each ended with its call, as all a call starts does


def test_no_server_process_outlives_close():
    config = server_config(env={"OPD_MCP_TEST": "close"})
    pid_tool, environment = mcp_tools(config.model_copy(update={"tools": ["pid", "environment"]}))
    assert run(environment, name="OPD_MCP_TEST").content == "close"  # env reaches the server
    client = mcp_client(config)
    first = int(run(pid_tool).content)
    assert client.server_pid == first
    client.close()
    assert not is_running(first) and client.server_pid is None
    second = int(run(pid_tool).content)  # a use after close starts it again
    assert second != first
    client.close()
    assert not is_running(second)


def test_a_server_that_cannot_start_is_a_clear_error_and_an_error_observation():
    missing = server_config(command=["/nonexistent/opd-mcp-server"])
    with pytest.raises(McpServerError, match="could not start: FileNotFoundError"):
        mcp_tools(missing)
    crashing = server_config(
        command=[sys.executable, "-c", "import sys; sys.stderr.write('no model named tiny'); sys.exit(3)"]
    )
    tool = tool_from_listing({"name": "echo", "inputSchema": {"type": "object"}}, crashing)
    assert tool is not None
    outcome = run(tool)
    assert not outcome.ok
    assert outcome.content.startswith("Error: echo failed: McpServerError: the MCP server")
    assert "no model named tiny" in outcome.content
    mcp_client(crashing).close()
    mcp_client(missing).close()


def test_the_config_refuses_what_cannot_work():
    with pytest.raises(ValidationError, match="command"):
        McpServerConfig(command=[])
    with pytest.raises(ValidationError, match="prefix"):
        server_config(prefix="my tools/")
    with pytest.raises(ValidationError, match="timeout_s"):
        server_config(timeout_s=0)
    with pytest.raises(ValidationError, match="extra"):
        McpServerConfig(command=["x"], url="http://localhost")


def test_without_the_mcp_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ImportError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        McpClient(server_config())
