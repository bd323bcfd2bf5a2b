"""Several teachers: which teacher scores each example (``route``), or with which weights they are mixed (``mixture``).

Assignments are read once, when the data is loaded (:class:`~opd.teachers.config.TeachersConfig`), so a malformed
row stops the run before any model loads. Batch rows inherit them (:func:`opd.data.batches.attach_teacher_fields`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from opd.utils.errors import DataError

ROUTES_BY_MODE = {"route": True, "mixture": False}
"""Whether each ``teachers.mode`` sends every example to one teacher (else every token meets the mixture)."""


@dataclass(frozen=True)
class TeacherChoice:
    """How each example is assigned its teacher(s).

    Routing: ``route_key`` names the example's teacher, through ``route_map`` (None: the value is the name);
    ``default`` serves examples without a usable value (None: required). Mixture: ``weights`` per member, or
    ``weights_key``, a field holding ``{teacher name: weight}``. ``names`` follow ``teachers.members`` order.
    """

    names: tuple[str, ...]
    mode: str
    route_key: str | None = None
    route_map: dict[str, str] | None = None
    default: str | None = None
    weights: tuple[float, ...] = ()
    weights_key: str | None = None

    @property
    def routes(self) -> bool:
        """Each example goes to one teacher (``teacher_index``); otherwise it carries mixture weights."""
        return ROUTES_BY_MODE[self.mode]

    def index_for(self, example: dict[str, Any]) -> int:
        """Routing: the position in ``names`` of the example's teacher; ``DataError`` (caller adds the row) if none."""
        assert self.route_key is not None  # a route config always has one (checked by the schema)
        value = example.get(self.route_key)
        if value is None:
            if self.default is None:
                raise DataError(
                    f'missing "{self.route_key}" (teachers.route_key), and teachers.default is not set; '
                    f"give every example the field, or name a default teacher"
                )
            return self.names.index(self.default)
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise DataError(f'"{self.route_key}" must be a string naming a teacher, got {type(value).__name__}')
        name = str(value) if self.route_map is None else self.route_map.get(str(value))
        if name is None:
            if self.default is None:
                raise DataError(
                    f'"{self.route_key}" = {value!r} is not in teachers.route_map '
                    f"({', '.join(sorted(self.route_map or {}))}) and teachers.default is not set"
                )
            return self.names.index(self.default)
        if name not in self.names:
            raise DataError(
                f'"{self.route_key}" = {value!r} names no teacher; teachers.members are {", ".join(self.names)}'
            )
        return self.names.index(name)

    def weights_for(self, example: dict[str, Any]) -> list[float]:
        """Mixture: the example's weight of each teacher, summing to 1; ``DataError`` (caller adds the row)."""
        if self.weights_key is None:
            raw = list(self.weights)
        else:
            given = example.get(self.weights_key)
            if not isinstance(given, dict):
                found = "missing" if given is None else f"a {type(given).__name__}"
                raise DataError(
                    f'"{self.weights_key}" (teachers.weights_key) must be an object {{teacher name: weight}}, '
                    f"found {found}"
                )
            unknown = sorted(set(given) - set(self.names))
            if unknown:
                members = ", ".join(self.names)
                raise DataError(f'"{self.weights_key}" names unknown teachers {unknown}; the members are {members}')
            raw = [given.get(name, 0.0) for name in self.names]
            for name, weight in zip(self.names, raw, strict=True):
                if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                    raise DataError(f'"{self.weights_key}".{name} must be a finite number, got {weight!r}')
        if any(weight < 0 for weight in raw) or sum(raw) <= 0:
            where = f'"{self.weights_key}"' if self.weights_key else "teachers.members[*].weight"
            raise DataError(f"{where}: weights must be >= 0 with a positive sum, got {raw}")
        total = float(sum(raw))
        return [float(weight) / total for weight in raw]
