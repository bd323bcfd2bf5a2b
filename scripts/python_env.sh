# Chooses the Python that the scripts install opd into and run with, and exports it as
# PYTHON. Sourced (never run) by install.sh, demo.sh, test.sh, lint.sh and .ci/run, from
# the repository root:
#
#   1. PYTHON set by the caller: used as given; no environment is created or checked.
#   2. `python3` runs inside a virtual environment (venv, virtualenv) or a conda
#      environment: that environment, as it is.
#   3. Otherwise the checkout's own .venv, created on first use with
#      `python3 -m venv --system-site-packages .venv` and reused after that. Nothing is
#      installed into python3 itself, which Debian and Ubuntu refuse for their own Python
#      (PEP 668, "externally-managed-environment"). --system-site-packages lets it see
#      what that Python already has, so an installed torch (say a CUDA build in a
#      container) is kept, not downloaded again.
#
# Prints one line saying which Python it chose, once: scripts that source it again, with
# PYTHON already exported, stay quiet.

_opd_python_env() {
  if [ -n "${PYTHON:-}" ]; then
    if [ -z "${OPD_PYTHON_ENV_CHOSEN:-}" ]; then
      echo "[env] using PYTHON=$PYTHON as given"
    fi
    return 0
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    echo "[env] error: no python3 on PATH; opd needs Python >= 3.10" >&2
    return 1
  fi
  # One line from the interpreter itself: which kind of environment it runs in, its
  # version and the path of its executable (an activated VIRTUAL_ENV is not required:
  # a venv's python run by its path is a venv too).
  local kind version executable
  read -r kind version executable < <(python3 - <<'PY'
import os, sys
if sys.prefix != sys.base_prefix or hasattr(sys, "real_prefix"):
    kind = "venv"
elif os.path.isdir(os.path.join(sys.prefix, "conda-meta")):
    kind = "conda"
else:
    kind = "none"
print(kind, "%d.%d.%d" % sys.version_info[:3], sys.executable)
PY
  ) || true
  if [ -z "${kind:-}" ]; then
    echo "[env] error: python3 ($(command -v python3)) did not run" >&2
    return 1
  fi
  local major_minor="${version%.*}"
  if [ "${major_minor%%.*}" -lt 3 ] || { [ "${major_minor%%.*}" -eq 3 ] && [ "${major_minor#*.}" -lt 10 ]; }; then
    echo "[env] error: python3 ($executable) is Python $version; opd needs Python >= 3.10" >&2
    return 1
  fi
  if [ "$kind" = venv ] || [ "$kind" = conda ]; then
    PYTHON="$executable"
    echo "[env] using the active $kind environment: $PYTHON"
    return 0
  fi
  _opd_checkout_venv "$executable"
}

# Case 3 above: reuses .venv, or creates it from python3 (whose executable is $1).
_opd_checkout_venv() {
  local venv=".venv" executable="$1"
  if [ -e "$venv" ]; then
    # A Python upgraded or removed under an old .venv leaves a python that does not run.
    if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
      echo "[env] error: $PWD/$venv is not a working virtual environment ($venv/bin/python -m pip fails);" \
        "delete it and run again, or activate an environment of your own" >&2
      return 1
    fi
    echo "[env] no virtual environment is active: using $PWD/$venv (activate it with: source $venv/bin/activate)"
  else
    echo "[env] no virtual environment is active: creating $PWD/$venv from python3 ($executable)" \
      "and installing into it (activate it with: source $venv/bin/activate)"
    # Debian/Ubuntu ship venv's pip bootstrap (ensurepip) in a package of its own; without
    # it `python3 -m venv` fails after writing part of the environment.
    if ! python3 -m venv --system-site-packages "$venv" >&2 || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
      rm -rf "$venv"
      echo "[env] error: python3 -m venv could not create $venv; on Debian/Ubuntu install the venv module" \
        "(sudo apt install python3-venv), or activate an environment of your own and run again" >&2
      return 1
    fi
  fi
  PYTHON="$PWD/$venv/bin/python"
}

_opd_python_env || exit 1
export PYTHON OPD_PYTHON_ENV_CHOSEN=1
