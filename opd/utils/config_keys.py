"""A config's unknown keys, found before the config models are imported.

The config models import torch and transformers, so a misspelt key would wait for those imports. This reads the
config as :func:`opd.utils.config.load_config` does and walks it against ``opd/config_keys.json`` (written from
the models by ``scripts/config_reference.py``), reporting unknown and moved keys in the full validation's words
and order. Everything else is left to the full validation; it never refuses a config the models accept.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from opd.utils.config import (
    invalid_config_message,
    load_config_tree,
    misplaced_key_hint,
    moved_key_problems,
    unknown_key_problem,
)
from opd.utils.errors import ConfigError

KEY_TABLE = "config_keys.json"


@cache
def _key_table() -> dict[str, Any]:
    return json.loads(resources.files("opd").joinpath(KEY_TABLE).read_text(encoding="utf-8"))


def check_config_keys(root: str, config_path: str | Path, overrides: list[str] | None = None) -> None:
    """Refuses a config with an unknown or moved key, as the full validation would word it.

    ``root`` is the key table's root: ``train`` (also ``opd eval`` and ``opd plan``), ``sft`` or ``generate``.

    Raises:
        ConfigError: every unknown key with what its section allows, a moved key, or a reading error.
    """
    table = _key_table()
    sections: dict[str, Any] = table["sections"]
    top = table["roots"][root]

    def variant_keys(section: str, tag: str) -> set[str] | None:
        shape = sections[top["section"]]["keys"].get(section)
        if not isinstance(shape, dict) or len(shape["variants"]) < 2 or tag not in shape["variants"]:
            return None
        return set(sections[shape["variants"][tag]]["keys"])

    tree = load_config_tree(config_path, overrides, variant_keys)
    moved = moved_key_problems(top["moved_keys"], tree)
    if moved:
        raise ConfigError(invalid_config_message(moved))
    problems = _section_problems(sections, top["section"], tree, "")
    if problems:
        raise ConfigError(invalid_config_message(problems))


def _section_problems(
    sections: dict[str, Any],
    name: str,
    value: dict[str, Any],
    dotted: str,
    choice: tuple[str, dict[str, str], str] | None = None,
) -> list[str]:
    """The unknown keys in the sections one section holds (in field order), then its own (as written): pydantic's order.

    ``choice`` is, for a variant, the choice's key, its variants and the chosen tag (to name misplaced keys).
    """
    section = sections[name]
    keys: dict[str, Any] = section["keys"]
    accepted = {**{key: key for key in keys}, **section.get("names", {})}
    problems: list[str] = []
    written_as = {accepted[given]: given for given in value if given in accepted}
    for key, shape in keys.items():
        given = written_as.get(key)
        if given is not None and shape is not None:
            problems += _value_problems(sections, shape, value[given], f"{dotted}.{given}" if dotted else given)
    if section.get("open"):
        return problems
    unknown = [given for given in value if given not in accepted]
    return problems + [
        unknown_key_problem(dotted, str(given), list(keys), _hint(sections, given, choice)) for given in unknown
    ]


def _hint(sections: dict[str, Any], given: Any, choice: tuple[str, dict[str, str], str] | None) -> str:
    """For a key unknown to a variant: which other variants of the choice take it (empty outside a choice)."""
    if choice is None:
        return ""
    owners = sorted(tag for tag, variant in choice[1].items() if given in sections[variant]["keys"])
    return misplaced_key_hint(str(given), choice[0], owners, choice[2])


def _value_problems(sections: dict[str, Any], shape: Any, value: Any, dotted: str) -> list[str]:
    """The unknown keys under one key whose table entry names a section, a list of them or a choice."""
    if isinstance(shape, str):
        return _section_problems(sections, shape, value, dotted) if isinstance(value, dict) else []
    if isinstance(shape, list):
        items = value if isinstance(value, list) else []
        return [
            problem
            for item in items
            if isinstance(item, dict)
            for problem in _section_problems(sections, shape[0], item, dotted)
        ]
    if not isinstance(value, dict):
        return []
    tag = str(value["type"]) if "type" in value else shape["default"]
    variant = shape["variants"].get(tag)
    if variant is None:  # no type, or one that is not a variant: the full validation says so
        return []
    return _section_problems(sections, variant, value, dotted, (dotted.rsplit(".", 1)[-1], shape["variants"], tag))
