"""Capturing and restoring every random-number stream of a run, for exact resume.

Covers Python's, NumPy's, torch's CPU and CUDA generators and the λ coin, stored as plain containers and tensors
so that checkpoints load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def capture_rng_state(lambda_coin: random.Random) -> dict[str, Any]:
    """Returns the state of every generator as tensors / lists / ints."""
    numpy_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": _to_lists(random.getstate()),
        "numpy": {
            "kind": numpy_state[0],
            "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "pos": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "torch": torch.get_rng_state(),
        "lambda_coin": _to_lists(lambda_coin.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], lambda_coin: random.Random) -> None:
    """Puts every generator back to a state made by :func:`capture_rng_state`."""
    random.setstate(_to_tuples(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    lambda_coin.setstate(_to_tuples(state["lambda_coin"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(value: Any) -> Any:
    """Tuples → lists, recursively (``weights_only`` loading accepts both, JSON only lists)."""
    if isinstance(value, (tuple, list)):
        return [_to_lists(item) for item in value]
    return value


def _to_tuples(value: Any) -> Any:
    """Lists → tuples, recursively: ``random.setstate`` requires tuples."""
    if isinstance(value, list):
        return tuple(_to_tuples(item) for item in value)
    return value
