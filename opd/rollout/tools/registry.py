"""Tools: plain Python callables registered by name, with a JSON schema for their arguments.

The schema is shown to the model (OpenAI function format, a chat template's ``tools``) and checks each call's
arguments before the tool runs (:func:`argument_problem`).
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Tool:
    """A callable the student may call by name.

    Attributes:
        function: called as ``function(**arguments)``; a string result is the tool's message as is, else JSON.
        description: what the tool does, shown to the model.
        parameters: JSON schema of the arguments, an ``object`` with ``properties``; every call's arguments are
            checked against all of it (the current draft, ``Draft202012Validator``) before the tool runs.
        thread_safe: declared safe to run on a thread of the rollout's process: bounded pure-Python work that
            neither prints, nor starts processes, nor can end its process (the ``ast`` calculator). Other tools run
            in a worker process under ``isolation: auto``.
        stateful: the tool keeps state between the calls of one episode (the Python tool's variables): each
            episode calls it in a worker process of its own, started at its first call and ended with the episode,
            so what a call leaves in the process (module globals) is there for the episode's next call and never
            for another episode's.
    """

    name: str
    function: Callable[..., Any]
    description: str
    parameters: dict[str, Any]
    thread_safe: bool = False
    stateful: bool = False

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, '_', '.' or '-' (not first)")
        if self.stateful and self.thread_safe:
            raise ValueError(f"tool {self.name!r}: a stateful tool runs in a process of its own, not on a thread")
        if not callable(self.function):
            raise ValueError(f"tool {self.name!r}: function must be callable, got {type(self.function).__name__}")
        if self.parameters.get("type") != "object" or not isinstance(self.parameters.get("properties", {}), dict):
            raise ValueError(
                f"tool {self.name!r}: parameters must be a JSON schema with type 'object' and a 'properties' mapping"
            )
        try:
            Draft202012Validator.check_schema(self.parameters)
        except SchemaError as error:
            raise ValueError(f"tool {self.name!r}: parameters is not a valid JSON schema: {error.message}") from None

    @cached_property
    def validator(self) -> Draft202012Validator:
        """Checks a call's arguments against :attr:`parameters`."""
        return Draft202012Validator(self.parameters)

    def schema(self) -> dict[str, Any]:
        """The tool as a chat template lists it (OpenAI function format)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolRegistry:
    """The tools of an environment, by name."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools or []:
            self.add(tool)

    def add(self, tool: Tool) -> Tool:
        """Registers ``tool``; ValueError when its name is taken."""
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        self._tools[tool.name] = tool
        return tool

    def register(
        self,
        name: str,
        function: Callable[..., Any],
        parameters: dict[str, Any],
        description: str = "",
        thread_safe: bool = False,
        stateful: bool = False,
    ) -> Tool:
        """Registers ``function`` as the tool ``name`` with the argument schema ``parameters``."""
        description = description or (function.__doc__ or "").strip()
        return self.add(Tool(name, function, description, parameters, thread_safe, stateful))

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's schema, for the chat template's ``tools``."""
        return [tool.schema() for tool in self._tools.values()]

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)


def argument_problem(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema (the most relevant error, naming where), or None when they do."""
    error = best_match(tool.validator.iter_errors(arguments))
    if error is None:
        return None
    where = "".join(f"[{part!r}]" for part in error.absolute_path)
    message = error.message
    if len(message) > 200:  # it quotes the value the model wrote, which may be of any length
        message = (
            f"{reprlib.repr(error.instance)} does not satisfy {error.validator}: {reprlib.repr(error.validator_value)}"
        )
    return f"arguments{where}: {message}"
