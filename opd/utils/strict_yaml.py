"""Reading YAML configs strictly: YAML 1.2's scalars, no duplicate keys, UTF-8 named when it fails.

PyYAML's YAML 1.1 reads ``yes`` / ``on`` as booleans, ``1e-5`` as a string, ``010`` as 8 and an ISO date as a
date. :class:`StrictYamlLoader` uses YAML 1.2's core schema instead (only ``true`` / ``false`` are booleans, ``1e-5``
is a float, ``010`` is 10, a date is a string), and a key written twice in one mapping is an error naming both lines.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import yaml
from yaml.constructor import ConstructorError, SafeConstructor

from opd.utils.errors import ConfigError

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
# YAML 1.1's types beyond JSON's, which a config cannot hold (OmegaConf refuses them): with an explicit tag
# (`!!binary`), an error naming the line; unquoted, a date is a string, as in YAML 1.2's core schema.
_NOT_CONFIG_VALUES = {
    _TIMESTAMP: "a date",
    "tag:yaml.org,2002:binary": "binary data",
    "tag:yaml.org,2002:set": "a set",
    "tag:yaml.org,2002:omap": "an ordered mapping",
    "tag:yaml.org,2002:pairs": "a list of pairs",
}

# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution).
_BOOL_PATTERN = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_PATTERN = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_PATTERN = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice."""

    def __init__(self, key: Any, first_line: int, second_line: int) -> None:
        super().__init__(f"key {key!r} appears twice in one mapping (lines {first_line} and {second_line})")
        self.key = key
        self.lines = (first_line, second_line)


# libyaml's parser (C) where PyYAML was built with it, as its wheels are: every command reads its config's files
# twice (the key check, then the full load), and the pure-Python parser was most of that (guide 05 has the cost).
# The resolvers and constructors below are Python either way.
_SafeLoader: type = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


class StrictYamlLoader(_SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core scalars and duplicate keys refused."""

    # YAML 1.1's bool / int / float resolvers out; YAML 1.2's are added below.
    yaml_implicit_resolvers: ClassVar[dict[Any, list[tuple[str, re.Pattern[str]]]]] = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *anchor` merges are overrides by design
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node))
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text, 10)  # 010 is ten, not YAML 1.1's octal eight

    def refuse_value(self, node: yaml.Node) -> None:
        raise ConstructorError(
            None,
            None,
            f"{node.tag.rsplit(':', 1)[-1]} ({_NOT_CONFIG_VALUES[node.tag]}) is not a config value; "
            "write plain strings, numbers, booleans, lists and mappings",
            node.start_mark,
        )


StrictYamlLoader.add_implicit_resolver(_BOOL, _BOOL_PATTERN, list("tTfF"))
StrictYamlLoader.add_implicit_resolver(_INT, _INT_PATTERN, list("-+0123456789"))
StrictYamlLoader.add_implicit_resolver(_FLOAT, _FLOAT_PATTERN, list("-+0123456789."))
StrictYamlLoader.add_constructor(_INT, StrictYamlLoader.construct_yaml_int)
StrictYamlLoader.add_constructor(_FLOAT, SafeConstructor.construct_yaml_float)
for _tag in _NOT_CONFIG_VALUES:
    StrictYamlLoader.add_constructor(_tag, StrictYamlLoader.refuse_value)


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's problem description with its 1-based line and column, on one line."""
    if isinstance(error, DuplicateKeyError):
        return str(error)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def parse_yaml_value(text: str) -> Any:
    """One scalar or flow value (a command-line override's right-hand side) with the same rules.

    Raises:
        yaml.YAMLError: not valid YAML.
    """
    return yaml.load(text, Loader=StrictYamlLoader)


def read_yaml_file(path: Path) -> Any:
    """A YAML file's content, read strictly (see the module docstring).

    Raises:
        ConfigError: naming the file (and line) when it is not UTF-8, is empty, or is not valid YAML.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path} is not UTF-8 text: byte {error.start + 1} (line {line}) cannot be decoded; "
            "save the file as UTF-8"
        ) from None
    if not text.strip() or all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines()):
        raise ConfigError(f"config file {path} is empty; start from examples/configs/distillation.yaml")
    try:
        return yaml.load(text, Loader=StrictYamlLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(error)}") from None
