"""Docstrings and comments under opd/ say what the code does and why, not where a figure came from.

Timings, machine descriptions, dates and references to the documents a feature was
specified in belong in docs/guide/ or benchmarks/, where their settings are written
beside them. The check reads only comments and string tokens (``tokenize``), so names
in code (``spec.seed``) are not matched, and its patterns are narrow enough that
ordinary text ("the random seed", "the process's cores", "YAML 1.2's core schema")
passes.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

OPD = Path(__file__).resolve().parents[2] / "opd"

FORBIDDEN = {
    "a seed document": re.compile(r"\bseed\s+(?:0\d\d|doc(?:ument)?s?)\b", re.IGNORECASE),
    "the specification's sections": re.compile(r"\bspec(?:ification)?'s\b", re.IGNORECASE),
    "a core count": re.compile(r"(?<![\d.])\b\d+(?:-core|\s+(?:idle\s+)?(?:CPU\s+)?cores)\b", re.IGNORECASE),
    "CPU-seconds": re.compile(r"\bCPU-s(?:econds?)?\b"),
    "a date": re.compile(
        r"\b20\d\d-[01]\d(?:-[0-3]\d)?\b"
        r"|\b(?:January|February|March|April|May|June|July|August|September|October|November|December)"
        r"(?:\s+[0-3]?\d,?)?\s+20\d\d\b"
        r"|\b(?:in|since|as of|until)\s+20\d\d\b"
    ),
    "a session's narration": re.compile(r"\bthis session\b|\bon an? [AH]\d{2,3}\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissue\s+#?\d+\b", re.IGNORECASE),
}
"""What a docstring or comment must not say, by what it is."""


def prose(source: str) -> list[tuple[int, str]]:
    """The comments and string literals of ``source``, with the line each starts on."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(token.start[0], token.string) for token in tokens if token.type in (tokenize.COMMENT, tokenize.STRING)]


def violations(text: str) -> list[str]:
    """The names of the patterns of :data:`FORBIDDEN` that ``text`` matches."""
    return [name for name, pattern in FORBIDDEN.items() if pattern.search(text)]


@pytest.mark.parametrize(
    "text",
    [
        "# the names of seed 002",
        '"""Loop settings (the specification\'s §4.3 keys)."""',
        "# the spec's figures",
        "# measured on the 2-core machine",
        "# 8 CPU-s instead of 13",
        "# took 4 s on 16 cores",
        "# 2 idle cores, OMP_NUM_THREADS=2",
        '"""Measured 2026-11-27."""',
        "# as of 2025, the default",
        "# fixed in issue 51",
    ],
)
def test_each_pattern_catches_what_it_names(text: str) -> None:
    assert violations(text), text


@pytest.mark.parametrize(
    "text",
    [
        "# the run's random seed (training.seed); seed 0 draws the same batches",
        "# on CPU they take turns on its cores",
        "# PyYAML's safe loader with YAML 1.2 core scalars",
        "# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution).",
        '"tag:yaml.org,2002:bool"',
        '"""(Mächler, "Accurately computing log(1 − exp(−|a|))", 2012)."""',
        '"""Device memory: H100 80 GB and H200 141 GB."""',
        "# the spec the rank was built from",
        "# the specification of a teacher (its path and dtype)",
    ],
)
def test_ordinary_text_passes(text: str) -> None:
    assert not violations(text), text


def test_no_docstring_or_comment_under_opd_cites_timings_dates_or_seed_documents() -> None:
    found = [
        f"{path.relative_to(OPD.parent)}:{line}: {', '.join(names)}: {text.strip()[:100]}"
        for path in sorted(OPD.rglob("*.py"))
        for line, text in prose(path.read_text(encoding="utf-8"))
        if (names := violations(text))
    ]
    assert not found, "say what and why; figures and their settings go to docs/guide/ or benchmarks/:\n" + "\n".join(
        found
    )
