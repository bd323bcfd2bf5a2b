"""opd's one way into ``torch.compile``, with inductor's kernel cache kept apart per forced CPU level.

opd's tests force ``ATEN_CPU_CAPABILITY=avx2`` so their float32 references hold on every x86-64 CPU. Inductor's
kernel cache does not separate kernels compiled under a forced level, and a default-level process loading them
can abort (``double free or corruption``). So a process that forces a level and chose no
``TORCHINDUCTOR_CACHE_DIR`` gets a cache of its own, named after the level; others keep the default cache.
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

from opd.utils.config import resolve_auto
from opd.utils.devices import is_cpu, is_cuda
from opd.utils.errors import ConfigError

FunctionT = TypeVar("FunctionT", bound=Callable[..., object])


def kernel_cache_dir_for(capability: str) -> str:
    """The inductor cache directory of processes that force ``ATEN_CPU_CAPABILITY=capability``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in a bare container: fall back to the uid
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}")


def separate_kernel_cache_for_forced_cpu_capability() -> None:
    """Points inductor at a cache of its own when ``ATEN_CPU_CAPABILITY`` is set (see the module docstring).

    Inductor fixes the directory at its first use, which importing torch's compiler stack can trigger, so
    ``import opd`` calls this first and :func:`compile_function` again.
    """
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = kernel_cache_dir_for(capability)


def compile_function(function: FunctionT, *, dynamic: bool = True) -> FunctionT:
    """``torch.compile(function, dynamic=dynamic)``, after choosing the kernel cache (see the module docstring)."""
    import torch  # here, so that importing this module never makes torch choose its kernels

    separate_kernel_cache_for_forced_cpu_capability()
    return cast(FunctionT, torch.compile(function, dynamic=dynamic))


def compiler_toolchain_problem(device_type: str) -> str | None:
    """What stops ``torch.compile`` building ``device_type`` kernels (no Triton, C++ compiler, Python.h), or None."""
    if is_cuda(device_type):  # looked up without importing it, which takes seconds
        missing = importlib.util.find_spec("triton") is None
        return "Triton is not installed (it ships with the CUDA builds of torch)" if missing else None
    if is_cpu(device_type):
        candidates = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
        if not any(candidate and shutil.which(candidate) for candidate in candidates):
            return "no C++ compiler found (set $CXX or install g++ / clang++)"
        headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if not headers.is_file():
            return f"the Python headers are missing ({headers}; on Debian/Ubuntu: apt install python3-dev)"
        return None
    return f"opd does not compile kernels for device type {device_type!r}"


def resolve_compile_kernels(
    setting: bool | str, device_type: str, key: str = "loss_fn.compile_kernels", *, pays_off: bool = True
) -> bool:
    """A compile setting (``auto`` / true / false) → whether to compile.

    ``auto`` compiles where the toolchain exists and the caller says it ``pays_off``. ``key`` names the setting.

    Raises:
        ConfigError: ``true`` was asked for but the toolchain is missing.
    """
    problem = compiler_toolchain_problem(device_type)
    compiles = bool(resolve_auto(setting, lambda: problem is None and pays_off))
    if compiles and problem is not None:  # asked for explicitly
        raise ConfigError(
            f"{key}: true cannot work on {device_type}: {problem}; install it or set {key} to auto or false"
        )
    return compiles
