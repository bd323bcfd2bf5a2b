"""Tools from an MCP server (Model Context Protocol) over stdio, through the official ``mcp`` SDK.

``pip install 'opd[mcp]'``. :func:`mcp_tools` starts the server's command as a child process, lists its tools and
returns one :class:`~opd.rollout.tools.registry.Tool` per server tool: its JSON schema is the server's
``inputSchema`` and its function calls the tool on the server and returns the text of the result. A result the
server marks as an error raises :class:`McpToolError`, which :func:`~opd.rollout.tools.sandbox.run_tool`
turns into an ``Error:`` observation like any other failure.

One :class:`McpClient` per server and process holds the session, on an event-loop thread of its own (the SDK is
asynchronous); it starts at the first use, starts again at the first use after its server ended, and is closed at
interpreter exit or by :meth:`McpClient.close` (:func:`close_mcp_clients` closes them all).

The server's stderr is kept only as a short tail for the errors that say why it failed; the server gets the few
environment variables the SDK passes on, plus ``env``.
"""

from __future__ import annotations

import asyncio
import atexit
import codecs
import concurrent.futures
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import Field

from opd.rollout.tools.registry import Tool
from opd.utils.config import StrictConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = "pip install 'opd[mcp]'"
"""How to install what this module needs."""
SHUTDOWN_TIMEOUT_S = 10.0
"""Longest wait for a session to close; the SDK's own shutdown (stdin closed, then SIGTERM, then SIGKILL of the
server's process group) is bounded well within it."""
PING_TIMEOUT_S = 5.0
"""Longest wait for the ping that tells a failed request from a server that ended."""
MAX_LIST_PAGES = 1000
"""Most pages of a server's tool listing read (a server that never stops paginating is refused)."""
STDERR_TAIL_CHARS = 2000
"""Characters of the server's stderr kept, to say why it failed to start or ended."""
STDERR_WAIT_S = 1.0
"""Longest wait for the last of a failed server's stderr (a process it started may hold the pipe open)."""


class McpServerConfig(StrictConfig):
    """An MCP server run as a child process and spoken to over its stdin and stdout."""

    command: list[str] = Field(
        ...,
        min_length=1,
        description="the server's command line, e.g. [python, -m, my_server]; the first item is the executable",
    )
    env: dict[str, str] | None = Field(
        None,
        description="environment variables of the server, set over the few the SDK passes on (HOME, PATH, USER, "
        "...); the run's own environment is not inherited",
    )
    tools: list[str] | None = Field(
        None, description="the server's tools to expose, by their names on the server; null = all of them"
    )
    prefix: str = Field(
        "",
        pattern=r"^[A-Za-z0-9_.-]*$",
        description="prepended to each tool's name as the student sees it (keeps two servers' tools apart)",
    )
    timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="longest wait for the server to start and for one call; a call abandoned earlier at "
        "environment.tool_timeout_s still ends here",
    )


class McpToolError(RuntimeError):
    """The server ran the tool and reported an error (the server's text)."""


class McpServerError(RuntimeError):
    """The server did not start, or ended, or did not answer."""


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as error:
        raise ImportError(f"tools from an MCP server need the mcp package: {INSTALL_HINT}") from error


def _dump(model: Any) -> dict[str, Any]:
    """An SDK result as the protocol writes it (camelCase keys, the same in SDK 1.x and 2.x)."""
    dumped: dict[str, Any] = model.model_dump(by_alias=True, mode="json", exclude_none=True)
    return dumped


def _leaf(error: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: the task groups of the SDK wrap what failed."""
    while isinstance(getattr(error, "exceptions", None), (list, tuple)) and error.exceptions:  # type: ignore[attr-defined]
        error = error.exceptions[0]  # type: ignore[attr-defined]
    return error


def _describe(error: BaseException) -> str:
    error = _leaf(error)
    try:
        message = str(error)
    except Exception:
        message = ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def result_text(result: dict[str, Any]) -> str:
    """The text of a ``tools/call`` result: its text parts joined by newlines, other parts named in brackets, the
    structured content as JSON where there are no parts."""
    parts = []
    for part in result.get("content") or []:
        kind = part.get("type")
        if kind == "text":
            parts.append(str(part.get("text", "")))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {part.get('mimeType', 'unknown type')}]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {part.get('uri', '')}]")
        elif kind == "resource":
            resource = part.get("resource") or {}
            text = resource.get("text")
            parts.append(text if isinstance(text, str) else f"[resource: {resource.get('uri', '')}]")
        else:
            parts.append(f"[{kind} content]")
    if not parts and result.get("structuredContent") is not None:
        return json.dumps(result["structuredContent"], ensure_ascii=False)
    return "\n".join(parts)


class _StderrTail:
    """The last characters a server wrote to its stderr, read from a pipe on a thread, so that an error can say why
    the server failed; the rest is dropped (a server's log never reaches the run's output)."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()
        self.writer = os.fdopen(write_end, "w")
        self._text = ""
        self._reader = threading.Thread(target=self._read, args=(read_end,), name="mcp-stderr", daemon=True)
        self._reader.start()

    def _read(self, read_end: int) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(4096):
                self._text = (self._text + decoder.decode(chunk))[-STDERR_TAIL_CHARS:]

    def close_writer(self) -> None:
        """Closes this process's write end: the server holds its own, and the reader sees the end when it ends."""
        with contextlib.suppress(OSError):
            self.writer.close()

    def said(self, wait_s: float = 0.0) -> str:
        """`` (its stderr ended with: ...)``, or nothing when it wrote nothing; waits at most ``wait_s`` for the
        pipe's end (a server that ended has written all it will)."""
        self._reader.join(wait_s)
        text = self._text.strip()
        return f" (its stderr ended with: {text[-500:]})" if text else ""


_Ready = concurrent.futures.Future[tuple[Any, Any, asyncio.Event, "int | None"]]
"""Where a starting session is handed to the thread that waits for it: the session, its read stream, its stop event
and the server's process id."""


def _children() -> set[int]:
    """This process's children (Linux: read from ``/proc``; elsewhere none are found)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as handle:
                found.update(int(pid) for pid in handle.read().split())
    return found


def _server_pid(before: set[int], command: list[str]) -> int | None:
    """The server's process id: the one new child whose command line is ``command`` (None where that is not one
    process, or ``/proc`` cannot tell). The SDK does not expose its process, and a look at it is the only sure way
    to tell that a server ended while idle."""
    started = []
    for pid in _children() - before:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
            if handle.read().split(b"\0")[:-1] == [os.fsencode(part) for part in command]:
                started.append(pid)
    return started[0] if len(started) == 1 else None


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux; True where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


@dataclass
class _Session:
    """One started server and the session with it."""

    session: Any
    read: Any
    stop: asyncio.Event
    holder: concurrent.futures.Future[None]
    stderr: _StderrTail
    pid: int | None

    def alive(self) -> bool:
        """Whether the session is open, the server's process runs and its stdout has not ended (the transport
        closes its end of the session's read stream when it does); a cheap look, without a request."""
        if self.holder.done() or (self.pid is not None and not _running(self.pid)):
            return False
        statistics = getattr(self.read, "statistics", None)
        return statistics is None or statistics().open_send_streams > 0


class McpClient:
    """One MCP server over stdio and this process's session with it.

    The SDK is asynchronous (anyio): the session lives on an event loop run by a daemon thread of this object, and
    the methods below submit to it from any thread and wait at most ``config.timeout_s``. Calls of several threads
    run at once on the one session. The server starts at the first use. When it ends, calls waiting on it fail with
    :class:`McpServerError`, and the next use starts it again (also one that comes after the server ended while
    idle). :meth:`close` ends the session and the server's process (a later use starts it again).
    """

    def __init__(self, config: McpServerConfig) -> None:
        _require_mcp()
        self.config = config
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._current: _Session | None = None
        self.starts = 0
        """Times the server was started (a restart after it ended counts)."""

    @property
    def _name(self) -> str:
        return f"MCP server {' '.join(self.config.command)!r}"

    # ------------------------------------------------------------------ the session's lifetime

    async def _hold(self, ready: _Ready, stderr: _StderrTail) -> None:
        """Starts the server, opens the session and keeps it until its ``stop`` event is set; the SDK's context
        managers end the server's process when they exit, however they exit."""
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        command, *args = self.config.command
        parameters = StdioServerParameters(command=command, args=args, env=self.config.env)
        stop = asyncio.Event()
        children = _children()
        try:
            async with stdio_client(parameters, errlog=stderr.writer) as (read, write):
                stderr.close_writer()  # the server has its copy now
                pid = _server_pid(children, self.config.command)
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    ready.set_result((session, read, stop, pid))
                    await stop.wait()
        except Exception as error:
            stderr.close_writer()  # first: the error may quote the stderr, whose end comes once no writer is left
            if not ready.done():
                ready.set_exception(error)
            # Not raised further: a session that ended is found by the next call, and an exception left in the
            # holder's future would only be logged as never retrieved.
            log.debug("%s: the session ended: %s", self._name, _describe(error))
        finally:
            stderr.close_writer()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
            self._thread.start()
        return self._loop

    def _start(self, timeout_s: float) -> _Session:
        """Starts the server and its session (called with the lock held)."""
        loop = self._ensure_loop()
        ready: _Ready = concurrent.futures.Future()
        stderr = _StderrTail()
        holder = asyncio.run_coroutine_threadsafe(self._hold(ready, stderr), loop)
        self.starts += 1
        try:
            session, read, stop, pid = ready.result(timeout_s)
        except concurrent.futures.TimeoutError:
            holder.cancel()  # the SDK's shielded shutdown still ends the process
            raise McpServerError(f"the {self._name} did not start within {timeout_s:g} s{stderr.said()}") from None
        except Exception as error:
            said = stderr.said(STDERR_WAIT_S)
            raise McpServerError(f"the {self._name} could not start: {_describe(error)}{said}") from _leaf(error)
        return _Session(session, read, stop, holder, stderr, pid)

    def _stop(self, current: _Session) -> None:
        """Ends ``current``'s session and its server's process, and waits for both (called with the lock held)."""
        if self._loop is not None and not current.holder.done():
            self._loop.call_soon_threadsafe(current.stop.set)
            with contextlib.suppress(Exception):
                current.holder.result(SHUTDOWN_TIMEOUT_S)

    @property
    def server_pid(self) -> int | None:
        """The process id of the running server (None: not started, or not known outside Linux)."""
        current = self._current
        return current.pid if current is not None and current.alive() else None

    def _started(self, timeout_s: float) -> tuple[_Session, asyncio.AbstractEventLoop]:
        """The live session, started (again) if there is none or its server ended."""
        with self._lock:
            current = self._current
            if current is None or not current.alive():
                if current is not None:
                    log.warning("the %s ended%s; starting it again", self._name, current.stderr.said())
                    self._stop(current)
                self._current = None
                current = self._current = self._start(timeout_s)
            assert self._loop is not None
            return current, self._loop

    def close(self) -> None:
        """Ends the session and the server's process, then the event-loop thread."""
        with self._lock:
            if self._current is not None:
                self._stop(self._current)
                self._current = None
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return

        async def cancel_the_rest() -> None:  # calls still waiting on the closed session
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop).result(SHUTDOWN_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(SHUTDOWN_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    # ------------------------------------------------------------------ requests

    def _ended(self, current: _Session, loop: asyncio.AbstractEventLoop, timeout_s: float) -> bool:
        """Whether ``current``'s server is gone (a request failed: is it the request, or the connection?); a gone
        session is dropped, so the next use starts the server again."""
        alive = current.alive()
        if alive:
            try:
                ping = asyncio.run_coroutine_threadsafe(current.session.send_ping(), loop)
                ping.result(min(timeout_s, PING_TIMEOUT_S))
            except Exception:
                alive = False
        if not alive:
            with self._lock:
                if self._current is current:
                    self._stop(current)
                    self._current = None
        return not alive

    def _request(self, request: Callable[[Any], Coroutine[Any, Any, T]], what: str, timeout_s: float | None) -> T:
        """Runs ``request(session)`` on the event loop and waits for it (and for a start) at most ``timeout_s``
        (None: ``config.timeout_s``)."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        current, loop = self._started(timeout_s)
        future = asyncio.run_coroutine_threadsafe(request(current.session), loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{what}: the {self._name} did not answer within {timeout_s:g} s") from None
        except Exception as error:
            if self._ended(current, loop, timeout_s):
                said = current.stderr.said(STDERR_WAIT_S)
                raise McpServerError(
                    f"{what}: the {self._name} ended ({_describe(error)}){said}; it is started again at the next call"
                ) from _leaf(error)
            raise

    def list_tools(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """The server's tools as the protocol lists them (``name``, ``description``, ``inputSchema``, ...)."""

        async def listing(session: Any) -> list[dict[str, Any]]:
            from mcp.types import PaginatedRequestParams

            listed: list[dict[str, Any]] = []
            cursor = None
            for _ in range(MAX_LIST_PAGES):
                params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
                page = _dump(await session.list_tools(params=params))
                listed += page.get("tools", [])
                cursor = page.get("nextCursor")
                if not cursor:
                    return listed
            raise McpServerError(f"the {self._name} listed more than {MAX_LIST_PAGES} pages of tools")

        return self._request(listing, "listing the tools", timeout_s)

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float | None = None) -> str:
        """Calls the server's tool ``name``: the result's text (:func:`result_text`); waits at most ``timeout_s``
        (None: ``config.timeout_s``).

        Raises:
            McpToolError: the server reported an error (its text).
            McpServerError: the server could not start, or ended (the next call starts it again).
            TimeoutError: no answer in time.
        """

        async def calling(session: Any) -> dict[str, Any]:
            return _dump(await session.call_tool(name, arguments))

        result = self._request(calling, name, timeout_s)
        if result.get("isError"):
            raise McpToolError(result_text(result) or "the tool reported an error")
        return result_text(result)


# --------------------------------------------------------------------------- this process's clients

_CLIENTS: dict[str, McpClient] = {}
_CLIENTS_LOCK = threading.Lock()


def mcp_client(config: McpServerConfig) -> McpClient:
    """This process's client of the server ``config`` describes (made at the first ask). Configs with the same
    ``command`` and ``env`` share it: their ``tools`` and ``prefix`` only choose and name what the student sees."""
    key = json.dumps([config.command, config.env])
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = McpClient(config)
    return client


def close_mcp_clients() -> None:
    """Closes every client of this process (their servers end); a later use starts a server again."""
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        client.close()


def _forget_clients_after_fork() -> None:
    """A forked child has the clients' state but none of their threads: it starts its own servers when it needs."""
    global _CLIENTS, _CLIENTS_LOCK
    _CLIENTS, _CLIENTS_LOCK = {}, threading.Lock()


atexit.register(close_mcp_clients)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_clients_after_fork)


@dataclass(frozen=True, eq=False)
class McpToolFunction:
    """A server tool as a :class:`Tool`'s function: ``function(**arguments)`` calls it through
    :func:`mcp_client`, so it pickles by value (a worker process of ``process`` isolation starts its own client)."""

    config: McpServerConfig
    name: str

    def __call__(self, **arguments: Any) -> str:
        return mcp_client(self.config).call(self.name, arguments, self.config.timeout_s)


def tool_from_listing(listed: dict[str, Any], config: McpServerConfig) -> Tool | None:
    """The :class:`Tool` for one tool of a server's listing, or None (with a warning naming it) when its name or
    schema is unusable."""
    name = listed.get("name")
    schema = listed.get("inputSchema")
    if not isinstance(schema, dict):
        log.warning("MCP server %r: tool %r is skipped: its inputSchema is not an object", config.command, name)
        return None
    try:
        return Tool(
            name=f"{config.prefix}{name}",
            function=McpToolFunction(config, str(name)),
            description=str(listed.get("description") or listed.get("title") or ""),
            parameters=schema,
            # On a thread of the rollout's process: the tool's work runs in the server's own process, and the call
            # on this side only sends a request and waits for the answer, at most config.timeout_s. (Under process
            # isolation each call would start a server in its worker, which ends it with the call.)
            thread_safe=True,
        )
    except ValueError as error:
        log.warning("MCP server %r: tool %r is skipped: %s", config.command, name, error)
        return None


def mcp_tools(config: McpServerConfig) -> list[Tool]:
    """The tools of the MCP server ``config`` describes (those ``config.tools`` names, or all), named with
    ``config.prefix``; starts the server if this process has not yet.

    Raises:
        ImportError: the ``mcp`` package is missing.
        McpServerError: the server did not start or answer the listing.
        ValueError: ``config.tools`` names a tool the server lacks.
    """
    _require_mcp()
    listed = mcp_client(config).list_tools(config.timeout_s)
    if config.tools is not None:
        by_name = {str(tool.get("name")): tool for tool in listed}
        missing = [name for name in config.tools if name not in by_name]
        if missing:
            raise ValueError(
                f"MCP server {config.command!r} has no tool {', '.join(map(repr, missing))}; it has "
                f"{', '.join(map(repr, sorted(by_name))) or 'none'}"
            )
        listed = [by_name[name] for name in config.tools]
    return [tool for tool in (tool_from_listing(entry, config) for entry in listed) if tool is not None]
