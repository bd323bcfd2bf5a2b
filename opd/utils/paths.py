"""Paths made absolute in the controller, before they reach a worker.

A Ray worker runs in a working directory of its own, possibly on another node: a
relative path that reaches it names another place than the controller meant. So the
controller turns every path a worker will read or write into an absolute one first:
directories it writes to (:func:`absolute_dir`) and local model directories
(:func:`absolute_model_path`), which must be told apart from hub names and ``tiny:``
presets that are not paths at all.
"""

from __future__ import annotations

from pathlib import Path


def absolute_dir(path: str | Path) -> Path:
    """``path`` made absolute against the controller's working directory (``~`` expanded)."""
    return Path(path).expanduser().absolute()


def absolute_model_path(path: str) -> str:
    """A model or tokenizer location as a worker must get it.

    A path that exists here (a local model directory) becomes absolute; anything else is
    a name that is not resolved against a directory (a Hugging Face hub name such as
    ``Qwen/Qwen2.5-1.5B-Instruct``, a ``tiny:`` preset) and is returned as it is.
    """
    local = Path(path).expanduser()
    return str(local.absolute()) if local.exists() else path
