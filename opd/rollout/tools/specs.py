"""Tools declared in the config: an importable callable, with its JSON schema given or derived from its signature.

``environment.tools`` lists built-in tools by name and declared tools as :class:`ToolSpec` mappings::

    tools:
      - calculator
      - function: my_package.tools:lookup      # module:attribute, importable where the run starts
        thread_safe: false                     # run it in a worker process (the default)
      - function: my_package.tools:search
        name: web_search
        parameters: {type: object, properties: {query: {type: string}}, required: [query]}

Without ``parameters`` the schema comes from the type hints (pydantic's schema of the signature), with each
argument's description from the docstring's ``Args:`` section and the tool's from its first paragraph.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pydantic
from pydantic import Field, field_validator

from opd.rollout.tools.registry import Tool
from opd.utils.config import StrictConfig

_PROPERTIES = "properties"
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def import_callable(path: str, key: str) -> Callable[..., Any]:
    """The callable at ``path`` (``package.module:attribute``); ValueError naming ``key`` when it cannot be had."""
    if not _IMPORT_PATH.match(path):
        raise ValueError(f"{key} = {path!r} must be 'package.module:attribute'")
    module_name, attribute = path.split(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{key} = {path!r}: module {module_name!r} cannot be imported ({error})") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{key} = {path!r}: {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{key} = {path!r} is a {type(found).__name__}, not a callable")
    return found


def _docstring_parts(function: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's first paragraph and its ``Args:`` descriptions by argument name."""
    doc = inspect.getdoc(function) or ""
    summary = doc.split("\n\n")[0].strip()
    arguments: dict[str, str] = {}
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, re.MULTILINE)
    if section is not None:
        current = None
        for line in section.group(1).splitlines():
            entry = re.match(r"^\s{2,4}(\*{0,2}\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if entry is not None:
                current = entry.group(1).lstrip("*")
                arguments[current] = entry.group(2).strip()
            elif current is not None and line.strip():
                arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    return summary, arguments


def _without_titles(schema: Any, properties: bool = False) -> Any:
    """``schema`` without pydantic's ``title`` annotations (the model reads names, not titles); ``properties``: the
    mapping is a ``properties`` object, whose keys are argument names (one may be called ``title``)."""
    if isinstance(schema, list):
        return [_without_titles(value) for value in schema]
    if not isinstance(schema, dict):
        return schema
    cleaned = {key: _without_titles(value, key == _PROPERTIES and not properties) for key, value in schema.items()}
    if not properties and isinstance(cleaned.get("title"), str):
        del cleaned["title"]
    return cleaned


def schema_from_signature(function: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``function``'s arguments, from its type hints, with the docstring's ``Args:`` text.

    Raises:
        ValueError: the signature has no JSON schema (an argument's type cannot be written as one).
    """
    try:
        schema = pydantic.TypeAdapter(function).json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticInvalidForJsonSchema, TypeError) as error:
        raise ValueError(f"the arguments of {function.__qualname__} have no JSON schema: {error}") from None
    schema = _without_titles(schema)
    _, described = _docstring_parts(function)
    for name, text in described.items():
        if name in schema.get("properties", {}) and "description" not in schema["properties"][name]:
            schema["properties"][name]["description"] = text
    schema.setdefault("properties", {})
    return schema


class ToolSpec(StrictConfig):
    """A tool declared in ``environment.tools``: an importable callable."""

    function: str = Field(
        ...,
        description="the tool's callable, 'package.module:attribute' (importable where the run starts and, in a "
        "worker process, by name: a top-level function)",
    )
    name: str | None = Field(None, description="the name the model calls; null = the function's name")
    description: str | None = Field(None, description="shown to the model; null = the docstring's first paragraph")
    parameters: dict[str, Any] | None = Field(
        None,
        description="JSON schema of the arguments (type object); null = derived from the type hints, with the "
        "docstring's Args: descriptions",
    )
    thread_safe: bool = Field(
        False,
        description="bounded pure-Python work that neither prints, nor starts processes, nor can end its process: "
        "run on a thread under tool_isolation auto (else in a worker process)",
    )
    stateful: bool = Field(
        False,
        description="keeps state across an episode's calls: each episode calls it in a worker process of its own, "
        "ended with the episode (module globals persist between its calls, never across episodes)",
    )

    @field_validator("function")
    @classmethod
    def _import_path(cls, path: str) -> str:
        if not _IMPORT_PATH.match(path):
            raise ValueError(f"{path!r} must be 'package.module:attribute'")
        return path

    def build(self, key: str) -> Tool:
        """The tool (``key`` names it in errors: ``environment.tools[2]``).

        Raises:
            ValueError: the function cannot be imported, its schema cannot be derived, or the tool is invalid.
        """
        function = import_callable(self.function, f"{key}.function")
        summary, _ = _docstring_parts(function)
        try:
            parameters = self.parameters if self.parameters is not None else schema_from_signature(function)
            return Tool(
                name=self.name or str(getattr(function, "__name__", "")),
                function=function,
                description=self.description if self.description is not None else summary,
                parameters=parameters,
                thread_safe=self.thread_safe,
                stateful=self.stateful,
            )
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
