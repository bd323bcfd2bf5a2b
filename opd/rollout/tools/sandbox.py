"""Running one tool call within limits: every failure becomes a message, never an exception.

:func:`run_tool` checks the arguments against the tool's schema, runs the tool, waits at most ``timeout_s`` and
cuts its text to ``max_output_chars``. Whatever goes wrong in the call (unknown tool, bad arguments, an exception,
a timeout, output that is not text, the tool ending its process) comes back as a failed :class:`ToolOutcome`
that tells the student why, so neither a tool nor the model takes the run down.

``thread`` isolation bounds the wait, not the work: Python cannot stop a thread, so a runaway tool keeps running
on its daemon thread, and a tool that ends the process ends the run. ``process`` isolation runs the tool in a warm
worker process (``forkserver`` where available, else ``spawn``), killed with its process group at the limit or
replaced when the tool ends it; on Linux its address space is capped at ``max_memory_mb``
(:mod:`opd.rollout.tools.workers`). A stateful tool always runs so, in its episode's own worker. The
function is pickled by name, so it must be importable (a top-level function); a lambda raises :class:`ValueError`.
Tools should still bound their own work, as the calculator does.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from opd.rollout.tools.outcome import ToolOutcome, as_text, cut, failure, failure_detail
from opd.rollout.tools.registry import Tool, argument_problem
from opd.rollout.tools.workers import WORKER_START_TIMEOUT_S, WORKERS, EpisodeWorkers
from opd.utils.config import resolve_auto


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of tool calls.

    Attributes:
        timeout_s, max_output_chars, max_memory_mb: per call (``max_memory_mb``: the worker's address space,
            process isolation on Linux only).
        isolation: ``auto`` runs a tool declared ``thread_safe`` on a thread and any other in a worker process;
            ``thread`` and ``process`` run every tool so (a stateful tool always runs in a process).
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
        if tool.stateful:  # its state lives in its episode's worker process
            return "process"
        return resolve_auto(self.isolation, lambda: "thread" if tool.thread_safe else "process")


def run_tool(
    tool: Tool | None,
    name: str,
    arguments: dict[str, Any],
    limits: SandboxLimits,
    episode: EpisodeWorkers | None = None,
) -> ToolOutcome:
    """Runs ``tool`` (None: no tool is called ``name``) with ``arguments`` within ``limits``.

    What the model wrote never raises: every failure is an ``Error:`` outcome cut to ``max_output_chars``. A
    stateful tool runs in ``episode``'s worker for it (None: a pooled worker, so its state lasts one call).

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
    return _ISOLATIONS[limits.isolation_of(tool)](tool, name, arguments, limits, episode)


def _run_on_thread(
    tool: Tool, name: str, arguments: dict[str, Any], limits: SandboxLimits, episode: EpisodeWorkers | None
) -> ToolOutcome:
    """:func:`run_tool` on a thread of this process: abandoned (not stopped) at the time limit."""
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["value"] = as_text(tool.function(**arguments))
        except BaseException as error:  # whatever the tool raises (even SystemExit) is an observation
            result["error"] = error

    worker = threading.Thread(target=call, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(limits.timeout_s)
    if worker.is_alive():
        return failure(f"{name} did not finish within {limits.timeout_s:g} s", limits.max_output_chars)
    if "error" in result:
        return failure(f"{name} failed: {failure_detail(result['error'])}", limits.max_output_chars)
    return ToolOutcome(cut(result["value"], limits.max_output_chars), True)


# --------------------------------------------------------------------------- process isolation


def _run_in_process(
    tool: Tool, name: str, arguments: dict[str, Any], limits: SandboxLimits, episode: EpisodeWorkers | None
) -> ToolOutcome:
    """:func:`run_tool` in a worker process: killed at the time limit, replaced if it ends.

    A stateless tool takes a warm worker from the pool; a stateful one the episode's own worker (``episode``).
    """
    try:
        function = pickle.dumps(tool.function)
    except Exception as error:
        raise ValueError(
            f"tool {name!r} cannot run in a worker process (environment.tool_isolation = {limits.isolation}): its "
            f"function is not importable by name ({failure_detail(error)}); define it at the top level of a module, "
            "or, for bounded pure-Python work, declare it thread_safe"
        ) from error
    try:
        payload = pickle.dumps((function, arguments, limits.max_output_chars))
    except (RecursionError, pickle.PicklingError):  # the model's arguments, nested past what pickle can walk
        return failure(f"{name}: the arguments are nested too deeply", limits.max_output_chars)
    lost = False
    try:
        if tool.stateful and episode is not None:
            worker, lost = episode.take(name, limits.max_memory_mb)
        else:
            worker = WORKERS.take(limits.max_memory_mb)
    except Exception as error:  # a worker that cannot start (the forkserver gone, the machine out of processes)
        return failure(f"{name}: the tool's process could not start ({failure_detail(error)})", limits.max_output_chars)
    # A stateful tool's state lives in its worker: when the worker ends, the student is told its state went too.
    state_note = " Its state is lost: the next call starts afresh." if tool.stateful else ""
    restarted = "(its earlier state was lost) " if lost else ""

    def ended(why: str) -> ToolOutcome:
        worker.stop()
        if tool.stateful and episode is not None:
            episode.ended(name)
        return failure(f"{restarted}{why}{state_note}", limits.max_output_chars)

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
        return ended(f"{name} ended its process (exit code {worker.process.exitcode})")
    if tool.stateful and episode is not None:
        episode.give_back(name, worker)
    else:
        WORKERS.give_back(worker)
    if reply == "unloadable":
        raise ValueError(
            f"tool {name!r} cannot run in a worker process (environment.tool_isolation = {limits.isolation}): the "
            f"worker could not import its function ({text}); define it at the top level of a module on its sys.path"
        )
    if reply == "error":
        return failure(f"{restarted}{name} failed: {text}", limits.max_output_chars)
    return ToolOutcome(cut(restarted + text, limits.max_output_chars) if restarted else text, True)  # cut there


_ISOLATIONS: dict[str, Callable[[Tool, str, dict[str, Any], SandboxLimits, EpisodeWorkers | None], ToolOutcome]] = {
    "thread": _run_on_thread,
    "process": _run_in_process,
}
"""How a tool is run under each :attr:`SandboxLimits.isolation`."""
