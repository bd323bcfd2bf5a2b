"""Loading YAML configs with command-line overrides, and validating them.

A config file is YAML. It may name parent files under a top-level ``defaults`` key
(a path or a list of paths, relative to the file), which are loaded first and then
overridden by the file's own keys, as NeMo-RL's example configs do. Command-line
overrides use dotted keys (``training.learning_rate=1e-5``) and are applied last.
``${...}`` interpolations (e.g. ``${output_dir}/logs``) are resolved by OmegaConf.

The merged tree is then validated by a pydantic model. Every problem (unknown key,
wrong type, out-of-range value) becomes one :class:`~opd.utils.errors.ConfigError`
whose message names the dotted key and what is allowed, before any model is loaded.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, ValidationError

from opd.utils.errors import ConfigError

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictConfig(BaseModel):
    """Base for config sections: unknown keys are errors and values are re-checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


def _first_line(error: Exception) -> str:
    """The first line of an exception's message (OmegaConf appends multi-line context)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's problem description with its 1-based line and column, on one line."""
    problem = getattr(error, "problem", None) or _first_line(error)
    mark = getattr(error, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _load_yaml_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Reads one YAML file and the parents it names under ``defaults``, merged."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config file {path}: 'defaults' forms a cycle")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(error)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
    parents = tree.pop("defaults", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged = OmegaConf.create()
    for parent in parents:
        parent_tree = _load_yaml_with_defaults(path.parent / parent, seen + (path,))
        merged = OmegaConf.merge(merged, OmegaConf.create(parent_tree))
    merged = OmegaConf.merge(merged, OmegaConf.create(tree))
    return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]


def load_config_tree(config_path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Loads a YAML config, applies ``key.sub=value`` overrides and resolves interpolations.

    Args:
        config_path: path to the YAML file.
        overrides: command-line overrides such as ``["training.learning_rate=1e-5"]``.

    Returns:
        The merged config as plain Python containers.

    Raises:
        ConfigError: on a missing/invalid file, a malformed override or a bad interpolation.
    """
    tree = OmegaConf.create(_load_yaml_with_defaults(Path(config_path)))
    for override in overrides or []:
        if "=" not in override or override.startswith("="):
            raise ConfigError(
                f"override '{override}' must look like key.sub=value (e.g. training.learning_rate=1e-5)"
            )
        try:
            tree = OmegaConf.merge(tree, OmegaConf.from_dotlist([override]))
        except yaml.YAMLError as error:  # the value after '=' is parsed as YAML
            raise ConfigError(f"override '{override}': the value is not valid YAML: {_yaml_problem(error)}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(f"override '{override}': {_first_line(error)}") from None
    try:
        return OmegaConf.to_container(tree, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as error:
        raise ConfigError(f"config interpolation failed: {_first_line(error)}") from None


def _allowed_keys(model_cls: type[BaseModel], location: tuple[Any, ...]) -> list[str]:
    """Field names (YAML spelling) of the config section at ``location``."""
    current: Any = model_cls
    for part in location:
        fields = getattr(current, "model_fields", None)
        if not fields:
            return []
        match = next(
            (info for name, info in fields.items() if (info.alias or name) == part or name == part),
            None,
        )
        if match is None:
            return []
        current = match.annotation
        # Optional[Section] and similar: take the pydantic model inside the union.
        for arg in getattr(current, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    fields = getattr(current, "model_fields", {})
    return [info.alias or name for name, info in fields.items()]


def _format_validation_error(model_cls: type[BaseModel], error: ValidationError) -> str:
    """Turns pydantic's report into short lines that name dotted keys and what is allowed."""
    lines = []
    for item in error.errors():
        location = tuple(item["loc"])
        key = ".".join(str(part) for part in location)
        if item["type"] == "extra_forbidden":
            allowed = _allowed_keys(model_cls, location[:-1])
            hint = difflib.get_close_matches(str(location[-1]), allowed, n=1)
            suggestion = f" (did you mean '{hint[0]}'?)" if hint else ""
            lines.append(
                f"unknown key '{key}'{suggestion}; allowed keys here: {', '.join(sorted(allowed))}"
            )
        elif item["type"] == "missing":
            lines.append(f"missing required key '{key}'")
        else:
            lines.append(f"{key} = {item.get('input')!r}: {item['msg']}")
    return "invalid config: " + "; ".join(lines)


def validate_config(model_cls: type[ModelT], tree: dict[str, Any]) -> ModelT:
    """Validates a config tree into a typed config object.

    Raises:
        ConfigError: naming every offending key and what it allows.
    """
    try:
        return model_cls.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(model_cls, error)) from None


def load_config(
    model_cls: type[ModelT], config_path: str | Path, overrides: list[str] | None = None
) -> ModelT:
    """Loads, overrides and validates a config file in one call (see :func:`load_config_tree`)."""
    return validate_config(model_cls, load_config_tree(config_path, overrides))


def config_to_yaml(config: BaseModel) -> str:
    """Dumps a validated config back to YAML, with the YAML key spellings (e.g. ``lambda``)."""
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)
