"""The environment variables of a cluster's worker processes: inherited where possible.

Every worker runs with a few variables of its own (its thread count, no tokenizer thread
pool). Ray can set them per actor through a ``runtime_env``, but an actor with one starts
through Ray's environment set-up process, which imports Ray once more before the worker
proper starts: most of a second of CPU per actor, paid again by every actor of every run.

A private cluster (one this process starts) needs none of that: its raylet, and so every
worker process it starts, inherits the environment ``ray.init`` was called in.
:func:`init_local_ray` starts the cluster with the workers' variables in that environment
(the caller's own environment is put back at once), and :func:`runtime_env_for` then asks
Ray for a ``runtime_env`` only for the variables a worker would not inherit: all of them on
a cluster this process joined, none on its own cluster when the values match.
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

    The variables are in this process's environment only while Ray starts its processes
    (which copy it); afterwards the caller's values, or their absence, are restored.
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
    """The ``runtime_env`` an actor of the connected cluster needs to run with ``env_vars``.

    Empty where the cluster's workers inherit every one of them (:func:`init_local_ray`):
    the actor then starts without Ray's environment set-up process.
    """
    inherited = _inherited.get(ray.get_runtime_context().gcs_address, {}) if ray.is_initialized() else {}
    missing = {key: value for key, value in env_vars.items() if inherited.get(key) != value}
    return {"env_vars": missing} if missing else {}
