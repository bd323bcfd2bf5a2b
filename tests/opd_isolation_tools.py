"""Misbehaving tools for the tool-isolation tests, in a module of their own.

A worker process imports a tool's function by name, so these live at the top level of
a light module on the tests' ``sys.path`` (importing a test module there would import
pytest and the test's own imports into every fresh worker).
"""

from __future__ import annotations

import os
import time


def process_id() -> int:
    return os.getpid()


def loop_forever() -> str:
    while True:
        time.sleep(0.01)


def exit_process() -> str:
    os._exit(3)


def fail(reason: str) -> str:
    raise RuntimeError(reason)


def leave() -> str:
    raise SystemExit(1)


def big() -> str:
    return "x" * 500


def structured() -> dict:
    return {"total": 3}


def not_text() -> object:
    return object()


def allocate() -> str:
    return str(len(bytearray(1024 * 2**20)))


def start_child_and_loop(pid_file: str) -> str:
    """Starts a long ``sleep`` process, writes its pid to ``pid_file``, then never returns."""
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as handle:
        handle.write(str(child.pid))
    while True:
        time.sleep(0.01)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception fails too")


def unprintable_error() -> str:
    """Raises an exception whose message cannot be read."""
    raise _Unprintable


def echo(text: object) -> object:
    """Returns what it was given (the model's own argument, of any size or depth)."""
    return text


def deep_result() -> list:
    """A result nested past what ``json.dumps`` can write."""
    value: list = []
    for _ in range(100_000):
        value = [value]
    return value


def print_and_return(text: str) -> str:
    """Prints to both standard streams, at the Python level and the file-descriptor level, then returns."""
    import sys

    print(f"LEAKED-STDOUT {text}")
    print(f"LEAKED-STDERR {text}", file=sys.stderr)
    os.write(1, f"LEAKED-FD1 {text}\n".encode())
    os.write(2, f"LEAKED-FD2 {text}\n".encode())
    return "printed"


def start_escaping_children(pid_file: str) -> str:
    """Starts a child that leaves the process group (setsid) and a grandchild orphaned by a double fork, writes both
    pids to ``pid_file`` and returns at once, as a tool that leaves daemons behind would."""
    import subprocess

    escaped = subprocess.Popen(["sleep", "60"], start_new_session=True)
    daemon_pid_file = pid_file + ".daemon"
    subprocess.run(
        ["sh", "-c", f"sleep 60 & echo $! > {daemon_pid_file}"], start_new_session=True, check=True
    )  # sh exits at once: its sleep is orphaned
    with open(pid_file, "w") as handle:
        handle.write(f"{escaped.pid} {open(daemon_pid_file).read().strip()}")
    return "started"


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie (killed, not yet reaped); reads ``/proc`` (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def leave_daemons() -> str:
    """Starts a child in a session of its own and an orphaned grandchild, then returns at once (no pid file: the
    fuzz finds them by the process tree)."""
    import subprocess

    subprocess.Popen(["sleep", "60"], start_new_session=True)
    subprocess.run(["sh", "-c", "sleep 60 &"], start_new_session=True, check=True)
    return "started"
