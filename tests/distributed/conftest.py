"""Shared fixtures of the cluster tests: one private local Ray cluster per test module."""

from __future__ import annotations

import os
import tempfile

import pytest
import ray

from opd.distributed.ray_cluster import RAY_ENVIRONMENT


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray cluster for the module (runs reuse it instead of starting their own)."""
    for key, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="opd_ray_test_", dir="/tmp"),
        configure_logging=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()
