"""The environment variables of a cluster's worker processes: inherited where possible.

An actor with a ``runtime_env`` starts through Ray's environment set-up process, which costs CPU per actor. A
private cluster's workers inherit the environment ``ray.init`` ran in, so :func:`init_local_ray` starts it with
the workers' variables set and :func:`runtime_env_for` asks only for variables a worker would not inherit.
"""

from __future__ import annotations

import os
from typing import Any

import ray

_inherited: dict[str, dict[str, str]] = {}
"""The variables every worker of a private cluster inherits, by the cluster's GCS address."""


def worker_environment(threads: int) -> dict[str, str]:
    """The environment of every worker: its thread count, and no tokenizer thread pool."""
    return {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


def init_local_ray(inherited: dict[str, str], **init_arguments: Any) -> None:
    """``ray.init(**init_arguments)`` of a private cluster whose workers inherit ``inherited``.

    The variables are set only while Ray starts its processes; the caller's environment is then restored.
    """
    saved = {key: os.environ.get(key) for key in inherited}
    os.environ.update(inherited)
    try:
        ray.init(**init_arguments)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _inherited[ray.get_runtime_context().gcs_address] = dict(inherited)


def runtime_env_for(env_vars: dict[str, str]) -> dict[str, Any]:
    """The ``runtime_env`` an actor of the connected cluster needs to run with ``env_vars`` (empty if inherited)."""
    inherited = _inherited.get(ray.get_runtime_context().gcs_address, {}) if ray.is_initialized() else {}
    missing = {key: value for key, value in env_vars.items() if inherited.get(key) != value}
    return {"env_vars": missing} if missing else {}
