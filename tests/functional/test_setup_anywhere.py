"""The README's scripts on a Python that refuses system-wide installs (PEP 668).

Debian and Ubuntu mark their ``python3`` as externally managed: a file named
``EXTERNALLY-MANAGED`` in ``sysconfig.get_path("stdlib")`` makes ``pip install`` stop with
``externally-managed-environment``. These tests build such an interpreter (a copy of this
Python's base installation under a temporary directory: the binary copied, the standard
library linked, an empty site directory holding only pip (``site-packages``, or Debian's
``dist-packages``: wherever that interpreter looks), and the marker), put it first on
PATH as ``python3`` and check how ``scripts/python_env.sh`` (sourced by install.sh,
demo.sh, test.sh and lint.sh) chooses the environment:

* no virtual or conda environment active: the checkout's ``.venv``, created on first use
  and reused after that;
* an active venv or conda environment, or ``PYTHON=...``: used as it is;
* clear errors for a Python older than 3.10, a Python without the venv module (Debian's
  separate ``python3-venv`` package), and a broken ``.venv``.

The full install (``scripts/install.sh`` into a fresh ``.venv`` from nothing: CPU torch
and every dependency, then one tiny distillation step; about 2 minutes on 2 shared cores) runs only where
``OPD_TEST_SETUP_ANYWHERE=1`` is set. CI does the real thing instead: its first run
(``.ci/run``) runs the README's two commands on the distribution's own ``python3``, which
creates ``.venv`` and installs into it from nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "python_env.sh"
STDLIB_NAME = f"python{sys.version_info.major}.{sys.version_info.minor}"
# pip's package directory, looked up on sys.path by hand: importing pip, or even
# importlib.util.find_spec("pip"), makes setuptools' distutils shim switch itself off for
# the rest of the session, after which torch.compile fails in every later test.
PIP_DIR = next((Path(entry) / "pip" for entry in sys.path if (Path(entry) / "pip" / "__init__.py").is_file()), None)
# What the checkout copy leaves out: git data, environments, run outputs and caches.
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".venv-*",
    "results",
    "__pycache__",
    "*.egg-info",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".benchmarks",
    "build",
    "dist",
)


def cannot_build_scratch_python(why: str) -> None:
    """Skips where this interpreter cannot be copied into a scratch prefix; fails where the full install runs.

    The scratch Python is a copy of the running interpreter's binary next to a symlinked
    stdlib. Interpreters laid out otherwise (a macOS framework build, a distribution
    Python whose binary lives outside its prefix) cannot be copied that way, and a user
    running the suite on one loses only this check of the scripts. A run asked for the
    full install (``OPD_TEST_SETUP_ANYWHERE=1``) must never pass without it, so there it
    fails. (Debian's own ``python3``, whose site directories are ``dist-packages``, is
    copied: :func:`scratch_site_packages`.)
    """
    if os.environ.get("OPD_TEST_SETUP_ANYWHERE") == "1":
        pytest.fail(f"cannot build the scratch externally-managed Python: {why}")
    pytest.skip(f"this interpreter cannot be copied into a scratch prefix: {why}")


def make_python(prefix: Path, externally_managed: bool = True, ensurepip: bool = True, conda: bool = False) -> Path:
    """A system-style (non-venv) copy of this Python's base installation; returns its bin dir.

    The binary is copied, not linked: Python finds its prefix from the resolved path of
    its executable, so a link would lead it back to the original installation.
    """
    base = Path(sys.base_prefix)
    binary = base / "bin" / STDLIB_NAME
    if not binary.is_file():
        cannot_build_scratch_python(f"no {binary} to copy a scratch interpreter from")
    bin_dir = prefix / "bin"
    bin_dir.mkdir(parents=True)
    shutil.copy2(binary, bin_dir / STDLIB_NAME)
    (bin_dir / "python3").symlink_to(STDLIB_NAME)
    if (base / "include").is_dir():
        (prefix / "include").symlink_to(base / "include")  # Python.h, which torch.compile's CPU kernels need
    stdlib = prefix / "lib" / STDLIB_NAME
    stdlib.mkdir(parents=True)
    for library in (base / "lib").glob("libpython*"):
        (prefix / "lib" / library.name).symlink_to(library)
    for entry in (base / "lib" / STDLIB_NAME).iterdir():
        # Debian's stdlib holds a dist-packages of its own: linking it would leak the system's packages.
        left_out = ("site-packages", "dist-packages", "EXTERNALLY-MANAGED")
        if entry.name in left_out or (entry.name == "ensurepip" and not ensurepip):
            continue
        (stdlib / entry.name).symlink_to(entry)
    site_packages = scratch_site_packages(bin_dir)
    site_packages.mkdir(parents=True)
    assert PIP_DIR is not None, "pip is not on sys.path"
    (site_packages / "pip").symlink_to(PIP_DIR)
    if externally_managed:
        (stdlib / "EXTERNALLY-MANAGED").write_text(
            "[externally-managed]\nError=this test's scratch Python refuses system-wide installs (PEP 668)\n"
        )
    if conda:
        (prefix / "conda-meta").mkdir()
    probe = subprocess.run(
        [str(bin_dir / "python3"), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True
    )
    if probe.returncode != 0 or Path(probe.stdout.strip()) != prefix:
        cannot_build_scratch_python(f"a copy of {binary} does not run from {prefix}: {probe.stdout}{probe.stderr}")
    return bin_dir


def scratch_site_packages(bin_dir: Path) -> Path:
    """The directory the scratch Python at ``bin_dir`` imports its installed packages from.

    ``lib/pythonX.Y/site-packages`` for a python.org or pyenv build; Debian and Ubuntu
    patch ``site`` so that their own Python reads ``dist-packages`` directories instead
    (``local/lib/pythonX.Y/dist-packages``, ``lib/python3/dist-packages``). Asked of the
    interpreter itself (``-S``: before any of those directories exists), so either layout
    gets pip where it looks.
    """
    prefix = bin_dir.parent
    probe = subprocess.run(
        [str(bin_dir / "python3"), "-S", "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        cannot_build_scratch_python(f"the scratch Python does not list its site directories: {probe.stderr}")
    inside = [Path(line) for line in probe.stdout.splitlines() if Path(line).is_relative_to(prefix)]
    if not inside:
        cannot_build_scratch_python(f"no site directory of the scratch Python lies under {prefix}: {probe.stdout}")
    return inside[0]


def script_env(first_on_path: Path, **extra: str) -> dict[str, str]:
    """This environment with ``first_on_path`` leading PATH and no trace of the caller's choice.

    test.sh exports PYTHON (and the marker that silences the helper) to the tests it runs;
    PYTHONPATH would make ``import opd`` succeed from anywhere.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHON", "OPD_PYTHON_ENV_CHOSEN", "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME")
    }
    env["PATH"] = f"{first_on_path}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def choose_python(checkout: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Sources scripts/python_env.sh as the scripts do (from the checkout root, ``set -euo pipefail``)."""
    command = 'set -euo pipefail; source "$1"; echo "PYTHON=$PYTHON"'
    return subprocess.run(
        ["bash", "-c", command, "bash", str(HELPER)], cwd=checkout, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def managed_bin(tmp_path_factory) -> Path:
    """The bin dir of an externally managed scratch Python (built once for this file)."""
    return make_python(tmp_path_factory.mktemp("managed") / "prefix")


def test_the_scratch_python_refuses_system_wide_installs(managed_bin):
    # What every `pip install` of the old install.sh ran into on Debian/Ubuntu.
    result = subprocess.run(
        [str(managed_bin / "python3"), "-m", "pip", "install", "--no-index", "opd"],
        capture_output=True,
        text=True,
        env=script_env(managed_bin),
    )
    assert result.returncode != 0
    assert "externally-managed-environment" in result.stdout + result.stderr


def test_no_active_environment_creates_the_checkout_venv_then_reuses_it(managed_bin, tmp_path):
    env = script_env(managed_bin)
    first = choose_python(tmp_path, env)
    assert first.returncode == 0, first.stderr
    venv_python = tmp_path / ".venv" / "bin" / "python"
    assert first.stdout.splitlines()[-1] == f"PYTHON={venv_python}"
    assert f"[env] no virtual environment is active: creating {tmp_path}/.venv from python3" in first.stdout
    config = (tmp_path / ".venv" / "pyvenv.cfg").read_text()
    assert f"home = {managed_bin}" in config
    assert "include-system-site-packages = true" in config  # an installed torch stays usable

    marker = tmp_path / ".venv" / "kept"
    marker.write_text("")
    second = choose_python(tmp_path, env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == [
        f"[env] no virtual environment is active: using {tmp_path}/.venv (activate it with: source .venv/bin/activate)",
        f"PYTHON={venv_python}",
    ]
    assert marker.exists() and (tmp_path / ".venv" / "pyvenv.cfg").read_text() == config  # not recreated


def test_an_active_venv_is_used_as_it_is(managed_bin, tmp_path):
    subprocess.run([str(managed_bin / "python3"), "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    result = choose_python(tmp_path, script_env(tmp_path / "env" / "bin"))
    assert result.returncode == 0, result.stderr
    env_python = tmp_path / "env" / "bin" / "python3"
    assert result.stdout.splitlines() == [
        f"[env] using the active venv environment: {env_python}",
        f"PYTHON={env_python}",
    ]
    assert not (tmp_path / ".venv").exists()


def test_a_conda_environment_is_used_as_it_is(tmp_path):
    bin_dir = make_python(tmp_path / "conda_env", externally_managed=False, conda=True)
    result = choose_python(tmp_path, script_env(bin_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"[env] using the active conda environment: {bin_dir / 'python3'}",
        f"PYTHON={bin_dir / 'python3'}",
    ]
    assert not (tmp_path / ".venv").exists()


def test_python_set_by_the_caller_is_used_as_given(managed_bin, tmp_path):
    given = str(managed_bin / "python3")
    result = choose_python(tmp_path, script_env(managed_bin, PYTHON=given))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"[env] using PYTHON={given} as given", f"PYTHON={given}"]
    assert not (tmp_path / ".venv").exists()
    # A script sourced by another one (demo.sh -> install.sh) inherits the choice silently.
    nested = choose_python(tmp_path, script_env(managed_bin, PYTHON=given, OPD_PYTHON_ENV_CHOSEN="1"))
    assert nested.stdout.splitlines() == [f"PYTHON={given}"]


def test_a_python_older_than_3_10_is_refused(tmp_path):
    # A stand-in python3 answering the helper's probe as a Python 3.9 outside any environment.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text("#!/bin/sh\ncat >/dev/null\necho none 3.9.18 /opt/py39/bin/python3.9\n")
    (fake_bin / "python3").chmod(0o755)
    result = choose_python(tmp_path, script_env(fake_bin))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "[env] error: python3 (/opt/py39/bin/python3.9) is Python 3.9.18; opd needs Python >= 3.10"
    )
    assert not (tmp_path / ".venv").exists()


def test_a_python_without_the_venv_module_gets_one_clear_error(tmp_path):
    # Debian/Ubuntu without the python3-venv package: `python3 -m venv` cannot bootstrap pip.
    bin_dir = make_python(tmp_path / "no_ensurepip", ensurepip=False)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    result = choose_python(checkout, script_env(bin_dir))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "[env] error: python3 -m venv could not create .venv; on Debian/Ubuntu install the venv module "
        "(sudo apt install python3-venv), or activate an environment of your own and run again"
    )
    assert not (checkout / ".venv").exists()  # no half-made environment for the next run to trip on


def test_a_broken_checkout_venv_is_reported_not_replaced(managed_bin, tmp_path):
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "notes.txt").write_text("")
    result = choose_python(tmp_path, script_env(managed_bin))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"[env] error: {tmp_path}/.venv is not a working virtual environment (.venv/bin/python -m pip fails); "
        "delete it and run again, or activate an environment of your own"
    )
    assert (tmp_path / ".venv" / "notes.txt").exists()


@pytest.mark.skipif(
    os.environ.get("OPD_TEST_SETUP_ANYWHERE") != "1",
    reason="installs torch and every dependency into a fresh .venv (~2 min); "
    "set OPD_TEST_SETUP_ANYWHERE=1 (CI installs from nothing on Debian's python3 instead)",
)
def test_install_sh_on_an_externally_managed_python_installs_into_a_fresh_venv(managed_bin, tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=NOT_COPIED)
    # PIP_NO_COMPILE=0 turns pip's byte-compiling off (pip reads the variable into its
    # `compile` setting): compiling torch's modules is over half of a fresh install's time.
    env = script_env(managed_bin, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PIP_NO_COMPILE="0")
    install = subprocess.run(
        ["bash", "scripts/install.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=1200
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    venv = checkout / ".venv"
    assert install.stdout.splitlines()[0].startswith(f"[env] no virtual environment is active: creating {venv}")
    assert install.stdout.splitlines()[-1] == f"[install] opd installed into {venv}"
    # Nothing went into the system-style Python: its site directory holds only pip.
    assert [p.name for p in scratch_site_packages(managed_bin).iterdir()] == ["pip"]

    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import json, opd, torch; print(json.dumps([opd.__file__, torch.__file__, torch.__version__]))",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    opd_file, torch_file, torch_version = json.loads(where.stdout)
    assert Path(opd_file) == checkout / "opd" / "__init__.py"  # the editable install of this checkout
    assert Path(torch_file).is_relative_to(venv)

    # Something real with it: one on-policy step of the tiny CPU config.
    run = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "examples/run_distillation.py",
            "--config",
            "examples/configs/distillation_tiny.yaml",
            f"output_dir={tmp_path / 'run'}",
            "training.max_num_steps=1",
            "training.val_freq=0",
            "training.save_freq=0",
            "validation.val_at_start=false",
            "distillation.generate_strategy.max_length=16",
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 1 and math.isfinite(losses[0])

    # A second run reuses the environment and its torch; only opd's editable install is redone.
    again = subprocess.run(
        ["bash", "scripts/install.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.splitlines()[:2] == [
        f"[env] no virtual environment is active: using {venv} (activate it with: source .venv/bin/activate)",
        f"[install] keeping the installed torch {torch_version}",
    ]
