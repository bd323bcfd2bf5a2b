"""Loading YAML configs with command-line overrides, and validating them.

A file is strict YAML (:mod:`opd.utils.strict_yaml`). Parent files named under a top-level ``defaults`` key (paths
relative to the file) load first and are overridden by the file's own keys; dotted command-line overrides
(``training.learning_rate=1e-5``) apply last; OmegaConf resolves ``${...}`` interpolations.

When a layer sets the ``type`` of a choice-of-variants section (``loss_fn``), inherited keys the chosen variant
lacks are dropped, so one objective's defaults never leak into another.

Validation by pydantic turns every problem into one :class:`~opd.utils.errors.ConfigError` naming the dotted key
and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import copy
import difflib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from opd.utils.errors import ConfigError, first_line
from opd.utils.strict_yaml import parse_yaml_value, read_yaml_file, yaml_problem

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictConfig(BaseModel):
    """Base for config sections: unknown keys are errors and values are re-checked on assignment.

    A boolean (YAML 1.1's ``yes`` / ``on`` included) or quoted string for a numeric key is refused, not coerced.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    moved_keys: ClassVar[dict[str, str]] = {}
    """Dotted keys of an older schema → where they live now (checked by :func:`validate_config`)."""

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_coerced(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None or not isinstance(value, (bool, str)):
            return value
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if not kinds & {int, float}:
            return value
        expected = "an integer" if float not in kinds else "a number"
        if isinstance(value, bool) and bool not in kinds:
            raise ValueError(f"expected {expected}, got the boolean {str(value).lower()}")
        if isinstance(value, str) and str not in kinds:
            if value.lower() in _YAML11_BOOLEAN_WORDS:
                raise ValueError(f"expected {expected}, got the word {value!r} (nor is it a boolean in YAML 1.2)")
            if _looks_numeric(value):
                raise ValueError(f"expected {expected}, got the string {value!r} (write it without quotes)")
            raise ValueError(f"expected {expected}, got the string {value!r}")
        return value


_YAML11_BOOLEAN_WORDS = frozenset({"yes", "no", "on", "off", "y", "n"})


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types a field annotation accepts (through ``X | None``, ``Annotated`` and ``Literal``)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {type(choice) for choice in get_args(annotation)}
    if origin in (Union, types.UnionType, Annotated):
        arguments = get_args(annotation)
        return set().union(
            *(_scalar_kinds(argument) for argument in (arguments[:1] if origin is Annotated else arguments))
        )
    if isinstance(annotation, type) and issubclass(annotation, (bool, int, float, str)):
        return {bool if issubclass(annotation, bool) else int if issubclass(annotation, int) else annotation}
    if isinstance(annotation, type) and issubclass(annotation, (Path,)):
        return {str}
    return set()


VariantKeys = Callable[[str, str], "set[str] | None"]
"""``(top-level section, type) -> the keys that variant accepts``; None: not a choice of variants."""


def _merge(base: dict[str, Any], incoming: dict[str, Any]) -> dict[str, Any]:
    """``incoming`` merged into ``base``, deeply: a mapping into a mapping key by key, anything else replaces
    (a list whole, ``null`` a section); interpolations stay unresolved. Keys keep ``base``'s order, new ones
    follow. The result is a copy: it shares nothing with the inputs.

    Plain dictionaries, not OmegaConf's merge: a config is merged once per file and per override, and OmegaConf
    copies the whole tree into its nodes and back each time (guide 05 has the cost), and it raises a bare
    ``TypeError`` where an override puts a list in place of a section.
    """
    merged: dict[str, Any] = {}
    for key, inherited in base.items():
        if key not in incoming:
            merged[key] = copy.deepcopy(inherited)
        elif isinstance(incoming[key], dict) and isinstance(inherited, dict):
            merged[key] = _merge(inherited, incoming[key])
        else:
            merged[key] = copy.deepcopy(incoming[key])
    for key, value in incoming.items():
        if key not in base:
            merged[key] = copy.deepcopy(value)
    return merged


def _plain(container: Any) -> dict[str, Any]:
    """A converted OmegaConf container, checked to be a mapping with string keys."""
    if not isinstance(container, dict):
        raise ConfigError("the top level of a config must be a mapping of keys")
    return {str(key): value for key, value in container.items()}


def _drop_keys_of_other_variants(
    tree: dict[str, Any], incoming: dict[str, Any], variant_keys: VariantKeys | None
) -> dict[str, Any]:
    """``tree`` without the inherited keys that a ``type`` set in ``incoming`` no longer accepts."""
    if variant_keys is None:
        return tree
    pruned = dict(tree)
    for section, value in incoming.items():
        if not (isinstance(value, dict) and "type" in value and isinstance(tree.get(section), dict)):
            continue
        accepted = variant_keys(section, str(value["type"]))
        if accepted is not None:
            pruned[section] = {key: item for key, item in tree[section].items() if key in accepted}
    return pruned


def _load_yaml_with_defaults(
    path: Path, seen: tuple[Path, ...] = (), variant_keys: VariantKeys | None = None
) -> dict[str, Any]:
    """Reads one YAML file and the parents it names under ``defaults``, merged."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config file {path}: 'defaults' forms a cycle")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    tree = read_yaml_file(path)
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
    parents = tree.pop("defaults", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = _merge(merged, _load_yaml_with_defaults(path.parent / parent, (*seen, path), variant_keys))
    return _merge(_drop_keys_of_other_variants(merged, tree, variant_keys), tree)


def _override_layer(override: str) -> dict[str, Any]:
    """``a.b.c=value`` as ``{"a": {"b": {"c": value}}}``, the value read as strict YAML."""
    key, text = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{override}': '{key}' is not a dotted key (e.g. training.learning_rate)")
    layer: dict[str, Any] = {parts[-1]: parse_yaml_value(text)}
    for part in reversed(parts[:-1]):
        layer = {part: layer}
    return layer


def load_config_tree(
    config_path: str | Path, overrides: list[str] | None = None, variant_keys: VariantKeys | None = None
) -> dict[str, Any]:
    """Loads a YAML config as plain containers, applies ``key.sub=value`` overrides and resolves interpolations.

    Overrides that set a section's ``type`` apply first. ``variant_keys`` None merges every section key by key.

    Raises:
        ConfigError: on a missing/invalid file, a malformed override or a bad interpolation.
    """
    tree = _load_yaml_with_defaults(Path(config_path), variant_keys=variant_keys)
    ordered = sorted(overrides or [], key=lambda override: not override.split("=", 1)[0].endswith(".type"))
    for override in ordered:
        if "=" not in override or override.startswith("="):
            raise ConfigError(f"override '{override}' must look like key.sub=value (e.g. training.learning_rate=1e-5)")
        try:
            layer = _override_layer(override)
            if "${" in override:
                OmegaConf.create(layer)  # an interpolation's syntax, checked here to name the override
            tree = _merge(_drop_keys_of_other_variants(tree, layer, variant_keys), layer)
        except yaml.YAMLError as error:  # the value after '=' is parsed as YAML
            raise ConfigError(f"override '{override}': the value is not valid YAML: {yaml_problem(error)}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(f"override '{override}': {first_line(error)}") from None
    try:
        return _plain(OmegaConf.to_container(OmegaConf.create(tree), resolve=True))
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        raise ConfigError(f"config interpolation failed{f' at {key}' if key else ''}: {first_line(error)}") from None


def _variants(annotation: Any) -> dict[str, type[BaseModel]]:
    """The config sections an annotation allows, by tag: a discriminated union's variants,
    or the one section inside ``Optional[Section]`` (tag ``""``)."""
    found: dict[str, type[BaseModel]] = {}
    pending = [annotation]
    while pending:
        current = pending.pop()
        if isinstance(current, type) and issubclass(current, BaseModel):
            tag_field = current.model_fields.get("type")
            tag = tag_field.default if tag_field is not None and isinstance(tag_field.default, str) else ""
            found[tag] = current
            continue
        pending.extend(arg for arg in get_args(current) if arg is not None)
    return found


def _section_at(model_cls: type[BaseModel], location: tuple[Any, ...]) -> tuple[type[BaseModel] | None, str]:
    """The config section at ``location`` and the dotted YAML key of it (union tags dropped)."""
    current: type[BaseModel] | None = model_cls
    names: list[str] = []
    for part in location:
        if current is None:
            return None, ".".join(names)
        fields = current.model_fields
        match = next((info for name, info in fields.items() if (info.alias or name) == part or name == part), None)
        if match is None:
            # A discriminated union puts the variant's tag in the location: already resolved.
            continue
        names.append(str(part))
        variants = _variants(match.annotation)
        current = next(iter(variants.values())) if len(variants) == 1 else None
        if len(variants) > 1:
            # The next part of the location is the tag of the variant that was validated.
            index = location.index(part) + 1
            tag = location[index] if index < len(location) else None
            current = variants.get(str(tag)) if tag is not None else None
    return current, ".".join(names)


def _keys_of(section: type[BaseModel] | None) -> list[str]:
    return [info.alias or name for name, info in section.model_fields.items()] if section is not None else []


def _misplaced_key_hint(model_cls: type[BaseModel], location: tuple[Any, ...], key: str) -> str:
    """For a key refused by one variant of a union (``location`` ends section, tag, key): the variants that have it."""
    if len(location) < 3:
        return ""
    parent, _ = _section_at(model_cls, location[:-3])
    info = parent.model_fields.get(str(location[-3])) if parent is not None else None
    variants = _variants(info.annotation) if info is not None else {}
    if len(variants) < 2:
        return ""
    owners = sorted(tag for tag, section in variants.items() if key in _keys_of(section))
    return misplaced_key_hint(key, str(location[-3]), owners, str(location[-2]))


def misplaced_key_hint(key: str, section: str, owners: list[str], chosen: str) -> str:
    """The note on a key that the chosen variant of ``section`` lacks but ``owners`` (other variants) have."""
    return f" ({key} belongs to {section}.type = {' / '.join(owners)}, not {chosen})" if owners else ""


def unknown_key_problem(parent: str, name: str, allowed: list[str], misplaced_hint: str = "") -> str:
    """The line naming an unknown key, what it may have meant, and the keys its section allows.

    Shared by pydantic's report and :mod:`opd.utils.config_keys`. ``parent`` is the section's dotted key without
    list indices and variant tags ("" at the top).
    """
    key = f"{parent}.{name}" if parent else name
    hint = difflib.get_close_matches(name, allowed, n=1)
    # A key of another variant is more likely than a typo (kl_type is not a misspelt type).
    suggestion = misplaced_hint or (f" (did you mean '{hint[0]}'?)" if hint else "")
    return f"unknown key '{key}'{suggestion}; allowed keys here: {', '.join(sorted(allowed))}"


def invalid_config_message(problems: list[str]) -> str:
    """One message for every problem of a config, in the order found."""
    return "invalid config: " + "; ".join(problems)


def _format_validation_error(model_cls: type[BaseModel], error: ValidationError) -> str:
    """Turns pydantic's report into short lines that name dotted keys and what is allowed."""
    lines = []
    for item in error.errors():
        location = tuple(item["loc"])
        _, dotted = _section_at(model_cls, location)
        if item["type"] == "extra_forbidden":
            section, parent = _section_at(model_cls, location[:-1])
            name = str(location[-1])
            hint = _misplaced_key_hint(model_cls, location, name)
            lines.append(unknown_key_problem(parent, name, _keys_of(section), hint))
        elif item["type"] == "missing":
            lines.append(f"missing required key '{dotted}'")
        elif not location:  # a check across sections: its message names the keys
            lines.append(str(item["msg"]).removeprefix("Value error, "))
        elif item["type"] == "union_tag_invalid":
            lines.append(f"{dotted}.type = {item['ctx']['tag']!r}: expected one of {item['ctx']['expected_tags']}")
        else:
            lines.append(f"{dotted} = {item.get('input')!r}: {str(item['msg']).removeprefix('Value error, ')}")
    return invalid_config_message(lines)


def moved_key_problems(moved: dict[str, str], tree: dict[str, Any]) -> list[str]:
    """Keys of an older schema (``moved``: old dotted key → where it lives now) still present in ``tree``."""
    problems = []
    for old, new in moved.items():
        node: Any = tree
        for part in old.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:
            problems.append(f"config key '{old}' has moved: it is now {new}")
    return problems


_ABSENT = object()


def validate_config(model_cls: type[ModelT], tree: dict[str, Any]) -> ModelT:
    """Validates a config tree into a typed config object.

    Raises:
        ConfigError: naming every offending key and what it allows, or where a ``moved_keys`` key lives now.
    """
    moved = moved_key_problems(getattr(model_cls, "moved_keys", {}), tree)
    if moved:
        raise ConfigError(invalid_config_message(moved))
    try:
        return model_cls.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(model_cls, error)) from None


def load_config(model_cls: type[ModelT], config_path: str | Path, overrides: list[str] | None = None) -> ModelT:
    """Loads, overrides and validates a config file in one call (see :func:`load_config_tree`)."""

    def variant_keys(section: str, tag: str) -> set[str] | None:
        info = model_cls.model_fields.get(section)
        variants = _variants(info.annotation) if info is not None else {}
        if len(variants) < 2:
            return None
        chosen = variants.get(tag)
        return set(_keys_of(chosen)) if chosen is not None else None

    return validate_config(model_cls, load_config_tree(config_path, overrides, variant_keys))


def config_to_yaml(config: BaseModel) -> str:
    """Dumps a validated config back to YAML, with the YAML key spellings (e.g. ``lambda``)."""
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)


SettingT = TypeVar("SettingT")


def resolve_auto(setting: SettingT | Literal["auto"], choose: Callable[[], SettingT]) -> SettingT:
    """``setting``, or what ``choose`` picks where it is ``auto``."""
    return choose() if setting == "auto" else setting
