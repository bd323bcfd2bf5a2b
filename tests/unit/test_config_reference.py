"""The configuration reference (``docs/guide/config-reference*.md``) and the key table
(``opd/config_keys.json``) are what the config models say.

``scripts/config_reference.py`` writes both from the pydantic models of ``opd train``,
``opd sft`` and ``opd generate``; this test regenerates them in memory and fails, with the
command that fixes it, when a committed page or the table differs, is missing or is left over.
"""

from __future__ import annotations

import json

import pytest
from opd_test_helpers import REPO_ROOT, load_script

from opd.losses.config import LOSS_VARIANTS

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


def test_the_committed_key_table_matches_the_models(reference):
    assert not reference.stale_key_table(reference.key_table_text()), (
        f"opd/config_keys.json differs from the config models: run `{reference.COMMAND}` and commit it"
    )


def test_the_key_table_names_every_key_and_section(reference):
    """Each key of each section reached from a root, with the sections it opens."""
    table = json.loads(reference.key_table_text())
    sections = table["sections"]
    root = sections[table["roots"]["train"]["section"]]
    assert list(root["keys"]) == [info.alias or name for name, info in reference.DistillationRoot.model_fields.items()]
    assert root["keys"]["training"] == "TrainingConfig"
    assert sections["DistillationTeachersConfig"]["keys"]["members"] == ["DistillationTeacherMemberConfig"]
    assert sections["DistillationTeachersConfig"]["keys"]["route_map"] is None  # free-form: its keys are names
    assert root["keys"]["loss_fn"]["default"] == "full_vocab"
    assert set(root["keys"]["loss_fn"]["variants"]) == set(LOSS_VARIANTS)
    assert sections["DistillationConfig"]["names"] == {"lambda_": "lambda"}
    for section in sections.values():
        for shape in section["keys"].values():
            named = [shape] if isinstance(shape, str) else shape if isinstance(shape, list) else []
            named += list(shape["variants"].values()) if isinstance(shape, dict) else []
            assert all(name in sections for name in named)


def test_every_key_of_the_distillation_config_is_documented(reference):
    """Each top-level key and each key of each section appears in a table row."""
    text = "\n".join(reference.render().values())
    for name, info in reference.DistillationRoot.model_fields.items():
        assert f"| `{info.alias or name}` |" in text
    for name in reference.DistillationRoot.model_fields["training"].annotation.model_fields:
        assert f"| `{name}` |" in text
