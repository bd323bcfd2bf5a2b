"""Makes ``tests/opd_test_helpers.py`` importable from every test module.

The suite runs with ``--import-mode=importlib``, which does not put test directories on
``sys.path``; shared test helpers therefore live in one uniquely named module here.
"""

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
