"""Running one tool call within limits: every failure becomes a message, never an exception.

:func:`run_tool` checks the arguments against the tool's schema, runs the tool, waits at most ``timeout_s`` and
cuts its text to ``max_output_chars``. Whatever goes wrong in the call (unknown tool, bad arguments, an exception,
a timeout, output that is not text, the tool ending its process) comes back as a failed :class:`ToolOutcome`
that tells the student why, so neither a tool nor the model takes the run down.

``thread`` isolation bounds the wait, not the work: Python cannot stop a thread, so a runaway tool keeps running
on its daemon thread, and a tool that ends the process ends the run. ``process`` isolation runs the tool in a warm
worker process (``forkserver`` where available, else ``spawn``), killed with its process group at the limit or
replaced when the tool ends it; on Linux its address space is capped at ``max_memory_mb``. The function is pickled
by name, so it must be importable (a top-level function); a lambda raises :class:`ValueError`. Tools should still
bound their own work, as the calculator does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from opd.rollout.environments.tools import Tool, argument_problem
from opd.utils.config import resolve_auto


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of tool calls.

    Attributes:
        timeout_s, max_output_chars, max_memory_mb: per call (``max_memory_mb``: the worker's address space,
            process isolation on Linux only).
        isolation: ``auto`` runs a tool declared ``thread_safe`` on a thread and any other in a worker process;
            ``thread`` and ``process`` run every tool so.
        max_calls_per_turn: calls of one turn that run; the rest are answered with an error, not run.
        turn_time_s: the wall time one turn's calls may take together (None: no cap but each call's own); a call
            gets at most the time left, and one that starts after it is spent is not run.
        episode_time_s: the same over all turns of an episode (None: no cap).
        parallelism: tool calls that run at once, over all episodes of a rollout; episodes are stepped that many
            at a time too.
    """

    timeout_s: float = 5.0
    max_output_chars: int = 2000
    isolation: Literal["auto", "thread", "process"] = "auto"
    max_memory_mb: int | None = 2048
    max_calls_per_turn: int = 8
    turn_time_s: float | None = None
    episode_time_s: float | None = None
    parallelism: int = 8

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {self.max_output_chars}")
        if self.isolation not in ("auto", "thread", "process"):
            raise ValueError(f"isolation must be 'auto', 'thread' or 'process', got {self.isolation!r}")
        if self.max_memory_mb is not None and self.max_memory_mb < 1:
            raise ValueError(f"max_memory_mb must be >= 1 or None, got {self.max_memory_mb}")
        for key in ("max_calls_per_turn", "parallelism"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("turn_time_s", "episode_time_s"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key} must be > 0 or None, got {value}")

    def isolation_of(self, tool: Tool) -> Literal["thread", "process"]:
        """Where ``tool``'s calls run."""
        return resolve_auto(self.isolation, lambda: "thread" if tool.thread_safe else "process")


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave the student: the ``tool`` message's text, and ``ok`` when the tool returned in its limits."""

    content: str
    ok: bool


def failure(reason: str, max_output_chars: int | None = None) -> ToolOutcome:
    """A failed call, as it reads to the student (cut to ``max_output_chars`` where given)."""
    text = f"Error: {reason}"
    return ToolOutcome(text if max_output_chars is None else _cut(text, max_output_chars), False)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}\n[output cut: {len(text)} characters, the limit is {limit}]"


def _failure_detail(error: BaseException) -> str:
    """``Type: message`` of what a tool raised; its ``str()`` is the tool's code too, and may itself raise."""
    try:
        message = str(error)
    except Exception:
        message = "(its message could not be read)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def run_tool(tool: Tool | None, name: str, arguments: dict[str, Any], limits: SandboxLimits) -> ToolOutcome:
    """Runs ``tool`` (None: no tool is called ``name``) with ``arguments`` within ``limits``.

    What the model wrote never raises: every failure is an ``Error:`` outcome cut to ``max_output_chars``.

    Raises:
        ValueError: in ``process`` isolation, the tool's function is not importable by name (a setup error).
    """
    if tool is None:
        return failure(f"there is no tool named {name!r}", limits.max_output_chars)
    try:
        problem = argument_problem(tool, arguments)
    except RecursionError:  # arguments nested past what the schema check can walk
        problem = "the arguments are nested too deeply"
    if problem is not None:
        return failure(f"{name}: {problem}", limits.max_output_chars)
    return _ISOLATIONS[limits.isolation_of(tool)](tool, name, arguments, limits)


def _run_on_thread(tool: Tool, name: str, arguments: dict[str, Any], limits: SandboxLimits) -> ToolOutcome:
    """:func:`run_tool` on a thread of this process: abandoned (not stopped) at the time limit."""
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = _as_text(tool.function(**arguments))
        except BaseException as error:  # whatever the tool raises (even SystemExit) is an observation
            result["error"] = error

    worker = threading.Thread(target=call, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(limits.timeout_s)
    if worker.is_alive():
        return failure(f"{name} did not finish within {limits.timeout_s:g} s", limits.max_output_chars)
    if "error" in result:
        return failure(f"{name} failed: {_failure_detail(result['error'])}", limits.max_output_chars)
    return ToolOutcome(_cut(result["value"], limits.max_output_chars), True)


# --------------------------------------------------------------------------- process isolation

WORKER_START_TIMEOUT_S = 60.0
"""Longest wait for a new worker process to be ready (not counted in a call's time limit)."""


def _serve_tools(connection: Connection, max_memory_mb: int | None) -> None:
    """A worker process's loop: receive ``(function, arguments, max_output_chars)``, answer ``(reply, text)``.

    What a call starts ends with it: the worker is a child subreaper (Linux), so every process the tool started,
    also one that left the process group or was orphaned, stays its descendant and is killed when the call returns.
    What tools print is dropped: file descriptors 1 and 2 point at ``/dev/null``.
    """
    if hasattr(os, "setsid"):
        os.setsid()  # its own process group: a kill at the limit also reaches what the tool started
    _become_subreaper()
    _drop_output()
    if max_memory_mb is not None and sys.platform == "linux":
        import resource

        limit = max_memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    connection.send(("ready", ""))
    while True:
        try:
            payload = connection.recv_bytes()
        except EOFError:  # the parent went away
            return
        try:
            pickled_function, arguments, max_output_chars = pickle.loads(payload)
            function = pickle.loads(pickled_function)  # may import the tool's module
        except BaseException as error:
            connection.send(("unloadable", _failure_detail(error)))
            continue
        connection.send(("loaded", ""))  # the time limit starts here, as the call does
        try:
            reply = ("value", _cut(_as_text(function(**arguments)), max_output_chars))
        except BaseException as error:  # whatever the tool raises (even SystemExit) is an observation
            reply = ("error", _failure_detail(error))
        kill_descendants(os.getpid())
        connection.send(reply)


_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Linux: orphans of this process's descendants are re-parented to it rather than to init, so they can be
    found (and killed) as its descendants. Elsewhere nothing: a process that leaves the group escapes there."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError, TypeError):  # no prctl outside Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _drop_output() -> None:
    """Points file descriptors 1 and 2 (and ``sys.stdout``, ``sys.stderr``) at ``/dev/null``: a tool's prints,
    its children's included, never reach the run's output."""
    null = os.open(os.devnull, os.O_WRONLY)
    for descriptor in (1, 2):
        os.dup2(null, descriptor)
    os.close(null)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - this process's streams, for its lifetime


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux: read from ``/proc``; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # ended meanwhile
            continue
        parent = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state": the parent's pid
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def _has_children() -> bool:
    """Whether this process has a child (Linux's per-thread ``children`` lists; True where they cannot be read)."""
    try:
        return any(
            Path(f"/proc/self/task/{task}/children").read_text().strip() for task in os.listdir("/proc/self/task")
        )
    except OSError:
        return True


def kill_descendants(pid: int) -> None:
    """Kills every process below ``pid`` (stopped first, so none forks meanwhile) and reaps the ones that are its
    children; a few rounds catch what was forked between a look and the kill."""
    if pid == os.getpid() and not _has_children():  # the common case, without reading all of /proc
        return
    for _ in range(10):
        found = _descendants(pid)
        if not found:
            return
        for signal_number in (signal.SIGSTOP, signal.SIGKILL):
            for descendant in found:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(descendant, signal_number)
        if pid == os.getpid():  # its children (an orphan's subreaper included) are reaped here
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass


class _ToolWorker:
    """One worker process and this process's end of its pipe."""

    def __init__(self, max_memory_mb: int | None) -> None:
        context: Any = multiprocessing.get_context(
            "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        )
        self.max_memory_mb = max_memory_mb
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve_tools, args=(child, max_memory_mb), daemon=True)
        self.process.start()
        child.close()
        try:
            if not self.connection.poll(WORKER_START_TIMEOUT_S):
                raise RuntimeError(f"a tool worker process did not start within {WORKER_START_TIMEOUT_S:g} s")
            self.connection.recv()
        except (EOFError, OSError) as error:
            self.stop()
            raise RuntimeError(
                f"a tool worker process ended while starting (exit code {self.process.exitcode}); a script that "
                "runs tools in processes needs the `if __name__ == '__main__':` guard, as any multiprocessing use"
            ) from error
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        """Kills the process, every process below it and its process group (whatever the tool started), and waits
        for it."""
        pid = self.process.pid
        if pid is not None:
            kill_descendants(pid)  # first: once the worker is gone, its orphans would leave its tree
        if pid is not None and hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.connection.close()


class _WorkerPool:
    """Idle warm workers, by memory limit; a call takes one (or starts one) and gives it back if it survived."""

    def __init__(self) -> None:
        self._idle: list[_ToolWorker] = []
        self._lock = threading.Lock()

    def take(self, max_memory_mb: int | None) -> _ToolWorker:
        with self._lock:
            dead = [worker for worker in self._idle if not worker.process.is_alive()]
            self._idle = [worker for worker in self._idle if worker not in dead]
            chosen = next((worker for worker in self._idle if worker.max_memory_mb == max_memory_mb), None)
            if chosen is not None:
                self._idle.remove(chosen)
        for worker in dead:  # ended while idle (killed from outside): reaped, not reused
            worker.stop()
        return chosen if chosen is not None else _ToolWorker(max_memory_mb)

    def give_back(self, worker: _ToolWorker) -> None:
        with self._lock:
            self._idle.append(worker)

    def stop_all(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.stop()

    def worker_pids(self) -> list[int]:
        """The idle workers' process ids (for tests)."""
        with self._lock:
            return [worker.process.pid for worker in self._idle if worker.process.pid is not None]


WORKERS = _WorkerPool()
"""This process's tool workers (``process`` isolation)."""
atexit.register(WORKERS.stop_all)


def _run_in_process(tool: Tool, name: str, arguments: dict[str, Any], limits: SandboxLimits) -> ToolOutcome:
    """:func:`run_tool` in a worker process: killed at the time limit, replaced if it ends."""
    try:
        function = pickle.dumps(tool.function)
    except Exception as error:
        raise ValueError(
            f"tool {name!r} cannot run in a worker process (environment.tool_isolation = {limits.isolation}): its "
            f"function is not importable by name ({_failure_detail(error)}); define it at the top level of a module, "
            "or, for bounded pure-Python work, declare it thread_safe"
        ) from error
    try:
        payload = pickle.dumps((function, arguments, limits.max_output_chars))
    except (RecursionError, pickle.PicklingError):  # the model's arguments, nested past what pickle can walk
        return failure(f"{name}: the arguments are nested too deeply", limits.max_output_chars)
    try:
        worker = WORKERS.take(limits.max_memory_mb)
    except Exception as error:  # a worker that cannot start (the forkserver gone, the machine out of processes)
        return failure(
            f"{name}: the tool's process could not start ({_failure_detail(error)})", limits.max_output_chars
        )

    def ended(why: str) -> ToolOutcome:
        worker.stop()
        return failure(why, limits.max_output_chars)

    try:
        worker.connection.send_bytes(payload)
        # Loading the function (importing its module in a fresh worker) is not the tool's time.
        if not worker.connection.poll(WORKER_START_TIMEOUT_S):
            return ended(f"{name}: its function did not load within {WORKER_START_TIMEOUT_S:g} s")
        reply, text = worker.connection.recv()
        if reply == "loaded":
            if not worker.connection.poll(limits.timeout_s):
                return ended(f"{name} did not finish within {limits.timeout_s:g} s")  # the tool ends with its process
            reply, text = worker.connection.recv()
    except (EOFError, OSError):  # the tool ended its process (os._exit, a crash, the memory limit's kill)
        worker.stop()  # reaped first: its exit code is known only then
        return failure(f"{name} ended its process (exit code {worker.process.exitcode})", limits.max_output_chars)
    WORKERS.give_back(worker)
    if reply == "unloadable":
        raise ValueError(
            f"tool {name!r} cannot run in a worker process (environment.tool_isolation = {limits.isolation}): the "
            f"worker could not import its function ({text}); define it at the top level of a module on its sys.path"
        )
    if reply == "error":
        return failure(f"{name} failed: {text}", limits.max_output_chars)
    return ToolOutcome(text, True)


_ISOLATIONS: dict[str, Callable[[Tool, str, dict[str, Any], SandboxLimits], ToolOutcome]] = {
    "thread": _run_on_thread,
    "process": _run_in_process,
}
"""How a tool is run under each :attr:`SandboxLimits.isolation`."""
