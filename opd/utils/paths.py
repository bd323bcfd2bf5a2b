"""Paths made absolute in the controller, before they reach a worker.

A Ray worker runs in a working directory of its own, possibly on another node, where a relative path would name
another place.
"""

from __future__ import annotations

from pathlib import Path


def absolute_dir(path: str | Path) -> Path:
    """``path`` made absolute against the controller's working directory (``~`` expanded)."""
    return Path(path).expanduser().absolute()


def absolute_model_path(path: str) -> str:
    """A model location for a worker: absolute if it exists here, else (a hub name, ``tiny:``) as it is."""
    local = Path(path).expanduser()
    return str(local.absolute()) if local.exists() else path
