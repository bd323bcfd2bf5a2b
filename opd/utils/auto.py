"""Settings whose value ``auto`` lets opd choose (from the hardware, the placement or the objective).

Each such setting is resolved by :func:`resolve_auto` with the choice that ``auto`` stands
for, so that ``auto`` is compared in one place and a setting given explicitly is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

SettingT = TypeVar("SettingT")


def resolve_auto(setting: SettingT | Literal["auto"], choose: Callable[[], SettingT]) -> SettingT:
    """``setting``, or what ``choose`` picks where it is ``auto``."""
    return choose() if setting == "auto" else setting
