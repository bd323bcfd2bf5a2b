"""The README and the guide stay short enough to read, and their links lead somewhere.

* every page of ``docs/guide/`` is under 600 lines, and ``README.md`` at most 200;
* every relative markdown link in ``README.md`` and ``docs/guide/*.md`` names a file that
  exists and, with ``#anchor``, a heading of that page (GitHub's anchor rule: the heading's
  text lowercased, punctuation but ``-`` and ``_`` dropped, each space a ``-``, and a
  repeated anchor suffixed ``-1``, ``-2``, ...).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guide"
README = REPO / "README.md"
GUIDE_PAGE_LINES = 600  # a guide page must stay below this
README_LINES = 200  # the README may have at most this many

# [text](target) or ![alt](target), the target up to the first space or ")" (an optional "title" after it).
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def _pages() -> list[Path]:
    return [README, *sorted(GUIDE.glob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            fence = None if fence == match.group(1) else (fence or match.group(1))
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    kept = []
    for char in text.strip().lower():
        if char == " ":
            kept.append("-")
        elif char in "-_" or unicodedata.category(char)[0] in "LMN":
            kept.append(char)
    return "".join(kept)


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of a markdown page produce, repeated ones suffixed as GitHub does."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every relative link on a page (no scheme, not ``mailto:``)."""
    links = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for match in _LINK.finditer(line):
            target = match.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue
            links.append((number, target))
    return links


def test_the_anchor_rule_is_githubs():
    assert github_anchor("8. What on-policy data buys: the λ study") == "8-what-on-policy-data-buys-the-λ-study"
    assert github_anchor("Teacher-made fixed data: `opd generate`") == "teacher-made-fixed-data-opd-generate"
    assert github_anchor("Where a step's time goes, and the settings_x") == "where-a-steps-time-goes-and-the-settings_x"
    assert github_anchor("A — B") == "a--b"


def test_the_guide_has_pages():
    assert (GUIDE / "README.md").is_file()
    assert len(list(GUIDE.glob("*.md"))) > 2


@pytest.mark.parametrize("page", sorted(GUIDE.glob("*.md")), ids=lambda page: page.name)
def test_a_guide_page_is_under_600_lines(page):
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines < GUIDE_PAGE_LINES, (
        f"{page.relative_to(REPO)} has {lines} lines; split it at a section into pages under "
        f"{GUIDE_PAGE_LINES} lines and list the new page in docs/guide/README.md"
    )


def test_the_readme_is_at_most_200_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_LINES, (
        f"README.md has {lines} lines (at most {README_LINES}): move measurements and details to "
        "the guide (docs/guide/) and link them"
    )


@pytest.mark.parametrize("page", _pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_lead_to_a_file_and_a_heading(page):
    broken = []
    for number, target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        file_part, anchor = unquote(file_part), unquote(anchor)
        destination = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(REPO)}:{number}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no file {file_part}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where}: no heading of {destination.name} makes the anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)
