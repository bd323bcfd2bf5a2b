"""Shared pytest setup: the test-helper import path and a clean ``opd`` logger per test.

The suite runs with ``--import-mode=importlib``, which does not put test directories on
``sys.path``; shared test helpers therefore live in one uniquely named module here.
"""

import logging
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
