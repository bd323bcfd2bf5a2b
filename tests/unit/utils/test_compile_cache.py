"""Inductor's kernel cache kept apart per forced CPU level (opd/utils/compile_cache.py).

The regression: on an AVX-512 CPU, a default-level run of the demo aborted with
``double free or corruption`` after the test suite (which forces ``avx2``) had filled the
shared kernel cache. The end-to-end test runs the fused loss's compiled kernel twice in
fresh processes sharing one temporary directory, first at the forced level and then at
the default one, exactly that order.
"""

import json
import os
import subprocess
import sys

import pytest

from opd.utils.compile_cache import kernel_cache_dir_for, separate_kernel_cache_for_forced_cpu_capability


@pytest.fixture
def clean_environment(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return monkeypatch


def test_a_forced_level_gets_a_cache_of_its_own(clean_environment):
    clean_environment.setenv("ATEN_CPU_CAPABILITY", "avx2")
    separate_kernel_cache_for_forced_cpu_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == kernel_cache_dir_for("avx2")
    assert kernel_cache_dir_for("avx2") != kernel_cache_dir_for("avx512")
    assert kernel_cache_dir_for("avx2").endswith("_avx2")


def test_the_default_level_and_an_explicit_cache_are_left_alone(clean_environment):
    separate_kernel_cache_for_forced_cpu_capability()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    clean_environment.setenv("ATEN_CPU_CAPABILITY", "avx2")
    clean_environment.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")
    separate_kernel_cache_for_forced_cpu_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"


# Runs the compiled closed-form divergence on fixed inputs and prints its largest error
# against the eager kernel, and the cache directory inductor used.
_KERNEL_RUN = """
import json, os, torch
from opd.kernels.compiled_kernels import compiled
from opd.losses.divergences import full_vocab_divergence_with_grad
generator = torch.Generator().manual_seed(0)
student = torch.randn(37, 301, generator=generator) * 3
teacher = torch.randn(37, 301, generator=generator) * 3
eager = full_vocab_divergence_with_grad(student, teacher)
fast = compiled(full_vocab_divergence_with_grad)(student, teacher)
error = max(float((a - b).abs().max()) for a, b in zip(eager, fast))
print(json.dumps({"error": error, "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
"""


@pytest.mark.slow  # compiles the loss kernels from nothing twice, in two fresh caches
def test_a_default_level_run_after_a_forced_level_run_uses_its_own_kernels(tmp_path):
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    environment.update(TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    reports = []
    for forced in ({"ATEN_CPU_CAPABILITY": "avx2"}, {}):
        finished = subprocess.run([sys.executable, "-c", _KERNEL_RUN], env={**environment, **forced},
                                  capture_output=True, text=True, timeout=600)
        assert finished.returncode == 0, f"{forced or 'default level'}: exit {finished.returncode}\n{finished.stderr}"
        reports.append(json.loads(finished.stdout.strip().splitlines()[-1]))
    forced_report, default_report = reports
    assert forced_report["cache"].startswith(str(tmp_path)) and forced_report["cache"].endswith("_avx2")
    assert default_report["cache"].startswith(str(tmp_path)) and default_report["cache"] != forced_report["cache"]
    assert forced_report["error"] < 1e-5 and default_report["error"] < 1e-5
