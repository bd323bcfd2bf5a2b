"""Several environments in one run: each example is played in the environment its data field names.

The field is read when the data is loaded (:meth:`RoutedEnvironment.route`), so a row naming no known environment
stops the run before any model loads, naming the row; the example then carries the environment's name
(``environment`` of a prepared example), and its prompt lists that environment's tools.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opd.rollout.environments.base import Environment, Episode
from opd.utils.errors import DataError

ROUTE_FIELD = "environment"
"""The prepared example's field holding the name of the environment that plays it."""


class RoutedEnvironment(Environment):
    """Plays each row in the member environment that ``row[route_key]`` names (``default`` where it names none).

    ``parallelism`` is the largest member's: each member still bounds its own tool calls.
    """

    def __init__(self, members: dict[str, Environment], route_key: str, default: str | None = None) -> None:
        if not members:
            raise ValueError("a routed environment needs at least one member")
        if default is not None and default not in members:
            raise ValueError(f"the default environment {default!r} is not one of {sorted(members)}")
        self.members = members
        self.route_key = route_key
        self.default = default
        self.parallelism = max(member.parallelism for member in members.values())

    def route(self, example: Mapping[str, Any]) -> str:
        """The name of the environment of a dataset example (its ``route_key`` field, else the default).

        Raises:
            DataError: the field is missing without a default, or names no member.
        """
        value = example.get(self.route_key)
        if value is None:
            if self.default is None:
                raise DataError(
                    f'missing "{self.route_key}" (environment.route_key), and environment.default is not set'
                )
            return self.default
        if not isinstance(value, str) or value not in self.members:
            raise DataError(
                f'"{self.route_key}" = {value!r} names no environment; environment.members are {sorted(self.members)}'
            )
        return value

    def member_of(self, row: Mapping[str, Any]) -> Environment:
        """The member that plays ``row`` (a prepared row carries :data:`ROUTE_FIELD`)."""
        name = row.get(ROUTE_FIELD)
        return self.members[name] if name is not None else self.members[self.route(row)]

    def start(self, row: Mapping[str, Any]) -> Episode:
        """An episode of ``row``'s environment."""
        return self.member_of(row).start(row)

    def tool_schemas(self, row: Mapping[str, Any] | None = None) -> list[dict[str, Any]] | None:
        """The tools of ``row``'s environment (None without a row: the members differ)."""
        return None if row is None else self.member_of(row).tool_schemas(row)
