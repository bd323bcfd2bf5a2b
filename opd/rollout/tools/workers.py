"""The worker processes of ``process`` isolation: a warm pool for stateless tools, and one process per episode
for each stateful tool.

A worker serves one call at a time: it loads the pickled function (importing its module), runs it and kills
whatever the call started before it answers. It is a process group and (Linux) a child subreaper of its own, with
its output dropped and (Linux) its address space capped.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from opd.rollout.tools.outcome import as_text, cut, failure_detail

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
            connection.send(("unloadable", failure_detail(error)))
            continue
        connection.send(("loaded", ""))  # the time limit starts here, as the call does
        try:
            reply = ("value", cut(as_text(function(**arguments)), max_output_chars))
        except BaseException as error:  # whatever the tool raises (even SystemExit) is an observation
            reply = ("error", failure_detail(error))
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


def _descendants(pid: int, running_only: bool = False) -> list[int]:
    """The processes below ``pid`` (Linux: read from ``/proc``; elsewhere none are found).

    ``running_only`` leaves out the ones that have ended (zombies not yet reaped, state Z or X): still below
    ``pid``, but nothing left to kill.
    """
    children: dict[int, list[int]] = {}
    ended: set[int] = set()
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # ended meanwhile
            continue
        state, parent = stat[stat.rindex(b")") + 2 :].split()[:2]  # after "pid (comm) ": state, the parent's pid
        children.setdefault(int(parent), []).append(int(entry.name))
        if state in (b"Z", b"X"):
            ended.add(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return [process for process in found if process not in ended] if running_only else found


def _has_children() -> bool:
    """Whether this process has a child (Linux's per-thread ``children`` lists; True where they cannot be read)."""
    try:
        return any(
            Path(f"/proc/self/task/{task}/children").read_text().strip() for task in os.listdir("/proc/self/task")
        )
    except OSError:
        return True


KILL_DEADLINE_S = 10.0
"""Longest wait for the processes below a worker to end once killed (one in uninterruptible sleep may not)."""


def kill_descendants(pid: int) -> None:
    """Kills every process below ``pid`` (stopped first, so none forks meanwhile), reaps the ones that are its
    children, and returns once none of them runs (or after :data:`KILL_DEADLINE_S`).

    It looks again until nothing below ``pid`` runs, not for a fixed number of rounds: a killed process runs on
    until it is next scheduled (on busy cores, after any number of quick rounds), and one killed in the middle of a
    ``fork`` leaves its new child to be re-parented to the subreaper only when it ends.
    """
    if pid == os.getpid() and not _has_children():  # the common case, without reading all of /proc
        return
    deadline = time.monotonic() + KILL_DEADLINE_S
    pause = 0.0
    while True:
        running = _descendants(pid, running_only=True)
        if not running or time.monotonic() > deadline:
            return
        for signal_number in (signal.SIGSTOP, signal.SIGKILL):
            for descendant in running:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(descendant, signal_number)
        if pid == os.getpid():  # its children (an orphan's subreaper included) are reaped here
            with contextlib.suppress(ChildProcessError):
                reaped = os.waitpid(-1, os.WNOHANG)[0]
                while reaped > 0:
                    reaped = os.waitpid(-1, os.WNOHANG)[0]
        time.sleep(pause)  # the first look again at once; then give the killed processes time to end
        pause = min(2 * pause or 0.001, 0.05)


class ToolWorker:
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
            # Stopped first: a tool still running (killed at its limit mid-spawn) would otherwise start a child
            # after the last look for descendants, which the worker's death then orphans out of its tree.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
            kill_descendants(pid)  # before the worker goes: once it is gone, its orphans would leave its tree
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
        self._idle: list[ToolWorker] = []
        self._lock = threading.Lock()

    def take(self, max_memory_mb: int | None) -> ToolWorker:
        with self._lock:
            dead = [worker for worker in self._idle if not worker.process.is_alive()]
            self._idle = [worker for worker in self._idle if worker not in dead]
            chosen = next((worker for worker in self._idle if worker.max_memory_mb == max_memory_mb), None)
            if chosen is not None:
                self._idle.remove(chosen)
        for worker in dead:  # ended while idle (killed from outside): reaped, not reused
            worker.stop()
        return chosen if chosen is not None else ToolWorker(max_memory_mb)

    def give_back(self, worker: ToolWorker) -> None:
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


class EpisodeWorkers:
    """One episode's worker processes for its stateful tools: one per tool, started at the tool's first call and
    kept between calls, where the tool's state lives; stopped when the episode ends (:meth:`release`).

    Never shared between episodes, so no episode reads another's state. A worker that ended (killed at a time
    limit, or ended by its tool) is replaced at the next call, without the state: :meth:`take` says so.
    """

    def __init__(self) -> None:
        self._workers: dict[str, ToolWorker] = {}
        self._lost: set[str] = set()
        self._lock = threading.Lock()

    def take(self, name: str, max_memory_mb: int | None) -> tuple[ToolWorker, bool]:
        """The worker of tool ``name`` (started now if it has none), and whether an earlier one's state was lost."""
        with self._lock:
            worker = self._workers.pop(name, None)
            lost = name in self._lost
            self._lost.discard(name)
        if worker is not None and not worker.process.is_alive():  # killed from outside between calls
            worker.stop()
            worker, lost = None, True
        return (worker if worker is not None else ToolWorker(max_memory_mb)), lost

    def give_back(self, name: str, worker: ToolWorker) -> None:
        """``worker`` survived its call: it keeps the tool's state for the episode's next call."""
        with self._lock:
            self._workers[name] = worker

    def ended(self, name: str) -> None:
        """The worker of tool ``name`` was stopped during a call: its state is gone."""
        with self._lock:
            self._lost.add(name)

    def release(self) -> None:
        """Stops every worker of the episode (its tools' state ends with it)."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.stop()

    def pids(self) -> list[int]:
        """The process ids of the episode's workers (for tests)."""
        with self._lock:
            return [worker.process.pid for worker in self._workers.values() if worker.process.pid is not None]
