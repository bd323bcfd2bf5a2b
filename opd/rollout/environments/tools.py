"""Tools: plain Python callables registered by name, with a JSON schema for their arguments.

The schema is shown to the model (OpenAI function format, a chat template's ``tools``) and checks each call's
arguments before the tool runs (:func:`argument_problem`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A callable the student may call by name.

    Attributes:
        function: called as ``function(**arguments)``; a string result is the tool's message as is, else JSON.
        description: what the tool does, shown to the model.
        parameters: JSON schema of the arguments: an ``object`` with ``properties`` (``required``,
            ``additionalProperties``).
    """

    name: str
    function: Callable[..., Any]
    description: str
    parameters: dict[str, Any]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, '_', '.' or '-' (not first)")
        if not callable(self.function):
            raise ValueError(f"tool {self.name!r}: function must be callable, got {type(self.function).__name__}")
        if self.parameters.get("type") != "object" or not isinstance(self.parameters.get("properties", {}), dict):
            raise ValueError(
                f"tool {self.name!r}: parameters must be a JSON schema with type 'object' and a 'properties' mapping"
            )

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
        self, name: str, function: Callable[..., Any], parameters: dict[str, Any], description: str = ""
    ) -> Tool:
        """Registers ``function`` as the tool ``name`` with the argument schema ``parameters``."""
        return self.add(Tool(name, function, description or (function.__doc__ or "").strip(), parameters))

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


def argument_problem(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool's ``schema``, or None when they do.

    Checks required keys, undeclared keys (``additionalProperties: false``) and each key's JSON ``type``; nested
    schemas are the tool's own to check.
    """
    properties: dict[str, Any] = schema.get("properties", {})
    missing = [key for key in schema.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)} (expected {', '.join(properties) or 'none'})"
    for key, value in arguments.items():
        declared = properties.get(key, {}).get("type")
        names = declared if isinstance(declared, list) else [declared]
        if declared is not None and not _is_json_type(value, names):
            return f"argument {key} must be of type {'/'.join(names)}, got {type(value).__name__}"
    return None


def _is_json_type(value: Any, names: list[str]) -> bool:
    """Whether ``value`` is of one of the JSON schema types ``names`` (an unknown type name accepts anything)."""
    allowed = tuple(kind for name in names for kind in _JSON_TYPES.get(name, (object,)))
    # bool is an int in Python but not a JSON integer or number.
    return isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
