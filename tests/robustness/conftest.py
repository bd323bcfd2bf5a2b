"""Shared by the robustness tests: the ``opd`` command line, run in this process."""

from __future__ import annotations

import logging

import pytest

from opd.cli import main


@pytest.fixture
def cli(capsys):
    """``opd.cli.main`` in this process: ``(status, stdout, stderr)``; opd's logger is put back afterwards."""
    opd_log = logging.getLogger("opd")
    saved = (list(opd_log.handlers), opd_log.level, opd_log.propagate)

    def run(*argv: str) -> tuple[int, str, str]:
        status = main(list(argv))
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    yield run
    opd_log.handlers[:], opd_log.level, opd_log.propagate = saved
