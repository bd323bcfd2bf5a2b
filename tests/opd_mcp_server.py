"""A tiny MCP server over stdio for the tests of opd.rollout.tools.mcp_tools: ``python opd_mcp_server.py``.

Written for the SDK's high-level server of either major version (``FastMCP`` in 1.x, ``MCPServer`` in 2.x).
"""

from __future__ import annotations

import asyncio
import os

try:
    from mcp.server.mcpserver import Image
    from mcp.server.mcpserver import MCPServer as Server
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as Server  # type: ignore[no-redef]
    from mcp.server.fastmcp import Image  # type: ignore[no-redef]

server = Server("opd-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Returns the text as given."""
    return text


@server.tool()
def fail(reason: str) -> str:
    """Always raises, with the reason."""
    raise ValueError(reason)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleeps, then answers (without holding up the server's other calls)."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def environment(name: str) -> str:
    """The value of an environment variable of the server, or an empty string."""
    return os.environ.get(name, "")


@server.tool()
def picture() -> list:
    """A caption and a one-pixel PNG."""
    png = bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"
    )
    return ["a pixel", Image(data=png, format="png")]


if __name__ == "__main__":
    server.run()
