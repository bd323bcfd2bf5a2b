"""Shared pytest setup: the test-helper import path and a clean ``opd`` logger per test.

The suite runs with ``--import-mode=importlib``, which does not put test directories on
``sys.path``; shared test helpers therefore live in one uniquely named module here.
"""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)


@pytest.fixture(autouse=True)
def _restore_opd_logger():
    """Gives every test the ``opd`` logger as it found it.

    Tests that call ``opd.cli.main`` in-process install opd's console handler and turn
    propagation off; without this, a later test that reads log records through ``caplog``
    would see none, depending on the order the tests ran in.
    """
    opd_log = logging.getLogger("opd")
    saved = (list(opd_log.handlers), opd_log.level, opd_log.propagate)
    yield
    opd_log.handlers[:], opd_log.level, opd_log.propagate = saved


@pytest.fixture(autouse=True, scope="session")
def _arithmetic_task_exists():
    """The demo's arithmetic task (``examples/data/arithmetic/``, generated, not committed) is on disk.

    Several test modules read it; without this, whether it existed depended on a demo test
    having run earlier in the same process. The generator is deterministic and writes each
    file atomically, so parallel test workers may both run it.
    """
    task_dir = Path(_TESTS_DIR).parent / "examples" / "data" / "arithmetic"
    if not all((task_dir / f"{split}.jsonl").is_file() for split in ("train", "val", "test")):
        generator = task_dir.parent / "make_arithmetic_task.py"
        subprocess.run([sys.executable, str(generator)], check=True, capture_output=True)
