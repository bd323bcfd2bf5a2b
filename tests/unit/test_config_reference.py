"""The configuration reference (``docs/guide/config-reference*.md``) is what the config models say.

``scripts/config_reference.py`` writes it from the pydantic models of ``opd train``,
``opd sft`` and ``opd generate``; this test regenerates it in memory and fails, with the
command that fixes it, when a committed page differs, is missing or is left over.
"""

from __future__ import annotations

import pytest
from opd_test_helpers import REPO_ROOT, load_script

pytestmark = pytest.mark.quick

SCRIPT = REPO_ROOT / "scripts" / "config_reference.py"


@pytest.fixture(scope="module")
def reference():
    return load_script(SCRIPT, register=True)  # its dataclasses look their module up in sys.modules


def test_the_committed_reference_matches_the_models(reference):
    pages = reference.render()
    stale = reference.stale_pages(pages)
    assert not stale, (
        f"the configuration reference differs from the config models in {', '.join(stale)}: "
        f"run `{reference.COMMAND}` and commit docs/guide/config-reference*.md"
    )


def test_every_key_of_the_distillation_config_is_documented(reference):
    """Each top-level key and each key of each section appears in a table row."""
    text = "\n".join(reference.render().values())
    for name, info in reference.DistillationRoot.model_fields.items():
        assert f"| `{info.alias or name}` |" in text
    for name in reference.DistillationRoot.model_fields["training"].annotation.model_fields:
        assert f"| `{name}` |" in text
