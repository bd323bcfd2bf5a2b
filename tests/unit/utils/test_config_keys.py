"""The fast check of a config's keys (:mod:`opd.utils.config_keys`), before the models are imported.

``opd train`` / ``eval`` / ``plan`` / ``sft`` / ``generate`` refuse a misspelt key from
``opd/config_keys.json`` without importing torch. These tests check that the refusal is the
one the full validation gives (same words, same order), that it comes from the command line
with exit status 2 before torch is imported, and that no shipped config is refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opd_test_helpers import REPO_ROOT, load_script

from opd.cli import EXIT_USER_ERROR
from opd.utils.config_keys import check_config_keys
from opd.utils.errors import ConfigError

pytestmark = pytest.mark.quick

CONFIGS = REPO_ROOT / "examples" / "configs"
ROOT_OF_COMMAND = {"train": "train", "plan": "train", "eval": "train", "sft": "sft", "generate": "generate"}

# name -> (root, the config's text after its `defaults:` line, overrides, the start of the error)
TYPOS = {
    "top_level": (
        "train",
        "demo.yaml",
        "trainng:\n  batch_size: 4\n",
        [],
        "unknown key 'trainng' (did you mean 'training'?)",
    ),
    "nested": (
        "train",
        "demo.yaml",
        "training:\n  batch_sise: 4\n",
        [],
        "unknown key 'training.batch_sise' (did you mean 'batch_size'?)",
    ),
    "loss_variant": (
        "train",
        "demo.yaml",
        "loss_fn:\n  type: jsd\n  bta: 0.3\n",
        [],
        "unknown key 'loss_fn.bta' (did you mean 'beta'?)",
    ),
    "other_variants_key": (
        "train",
        "demo.yaml",
        "loss_fn:\n  type: jsd\n  kl_type: forward\n",
        [],
        "unknown key 'loss_fn.kl_type' (kl_type belongs to loss_fn.type = full_vocab / topk, not jsd)",
    ),
    "teacher_member": (
        "train",
        "two_teachers_demo.yaml",
        "teachers:\n  members:\n    - name: add\n      model_pth: x\n",
        [],
        "unknown key 'teachers.members.model_pth' (did you mean 'model_path'?)",
    ),
    "teacher_members_loss": (
        "train",
        "two_teachers_demo.yaml",
        "teachers:\n  members:\n    - name: add\n      model_path: x\n      loss_fn: {type: jsd, kl_type: reverse}\n",
        [],
        "unknown key 'teachers.members.loss_fn.kl_type' (kl_type belongs to loss_fn.type = full_vocab / topk, not jsd)",
    ),
    "override": (
        "train",
        "demo.yaml",
        "",
        ["training.batch_sise=4"],
        "unknown key 'training.batch_sise' (did you mean 'batch_size'?)",
    ),
    "override_of_type": (
        "train",
        "demo.yaml",
        "",
        ["loss_fn.type=jsd"],
        # demo.yaml's kl_type is dropped with the variant it belonged to: nothing is wrong
        None,
    ),
    "several": (
        "train",
        "demo.yaml",
        "loggr: {}\ntraining:\n  batch_sise: 4\n",
        [],
        "unknown key 'training.batch_sise' (did you mean 'batch_size'?)",
    ),
    "moved": (
        "train",
        "demo.yaml",
        "distillation:\n  kl_type: forward\n",
        [],
        "config key 'distillation.kl_type' has moved",
    ),
    "sft": (
        "sft",
        "sft.yaml",
        "model:\n  model_pat: x\n",
        [],
        "unknown key 'model.model_pat' (did you mean 'model_path'?)",
    ),
    "generate": (
        "generate",
        "generate_demo.yaml",
        "generate:\n  only_corect: true\n",
        [],
        "unknown key 'generate.only_corect' (did you mean 'only_correct'?)",
    ),
}
"""Typos, each in a config that inherits a shipped one; the expected error follows ``invalid config: ``."""


def write_config(tmp_path: Path, name: str) -> Path:
    _, parent, body, _, _ = TYPOS[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"defaults: {CONFIGS / parent}\n{body}", encoding="utf-8")
    return path


def full_validation_error(root: str, path: Path, overrides: list[str]) -> str | None:
    """What ``load_config`` with the command's own model says (None: nothing about keys to refuse)."""
    from opd.distillation.config import MasterConfig
    from opd.generate import GenerateMasterConfig
    from opd.sft import SFTMasterConfig
    from opd.utils.config import load_config

    model = {"train": MasterConfig, "sft": SFTMasterConfig, "generate": GenerateMasterConfig}[root]
    try:
        load_config(model, path, overrides)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", sorted(TYPOS))
def test_the_fast_check_refuses_a_typo_in_the_full_validations_words(tmp_path, name):
    root, _, _, overrides, expected = TYPOS[name]
    path = write_config(tmp_path, name)
    full = full_validation_error(root, path, overrides)
    if expected is None:
        check_config_keys(root, path, overrides)
        assert full is None or "unknown key" not in full
        return
    with pytest.raises(ConfigError) as raised:
        check_config_keys(root, path, overrides)
    assert str(raised.value).startswith(f"invalid config: {expected}")
    if name == "several":  # the nested section first, then the top level's own, as pydantic orders them
        assert str(raised.value).index("training.batch_sise") < str(raised.value).index("'loggr'")
    # The same message as the full validation: here every problem is a key.
    assert str(raised.value) == full


def test_problems_other_than_keys_are_left_to_the_full_validation(tmp_path):
    path = tmp_path / "types.yaml"
    # A number that is not one, and a λ schedule with a typo: a value-or-section, whose
    # problems (every branch's) only the full validation can word.
    path.write_text(
        f"defaults: {CONFIGS / 'demo.yaml'}\ntraining:\n  batch_size: many\n"
        "distillation:\n  lambda: {schedule: linear, stat: 0.1}\n",
        encoding="utf-8",
    )
    check_config_keys("train", path)
    full = full_validation_error("train", path, [])
    assert full is not None and "training.batch_size = 'many'" in full


def test_a_key_given_by_its_field_name_is_accepted(tmp_path):
    path = tmp_path / "lambda.yaml"
    path.write_text(f"defaults: {CONFIGS / 'demo.yaml'}\ndistillation:\n  lambda_: 0.5\n", encoding="utf-8")
    check_config_keys("train", path)


def test_every_shipped_config_passes_the_fast_check():
    cases = load_script(REPO_ROOT / "tests" / "functional" / "test_shipped_configs.py", register=True).CASES
    assert sorted(cases) == sorted(path.name for path in CONFIGS.glob("*.yaml"))
    for name, case in cases.items():
        overrides = [argument for argument in case.overrides if "=" in argument]
        check_config_keys(ROOT_OF_COMMAND[case.command], CONFIGS / name)
        check_config_keys(ROOT_OF_COMMAND[case.command], CONFIGS / name, overrides)


def test_the_command_line_refuses_a_typo_with_exit_status_2(tmp_path):
    """Each typo through ``python -m opd``: status 2 and the one error line (the processes run together)."""
    names = ["top_level", "nested", "loss_variant", "teacher_member", "override", "sft", "generate"]
    processes = {}
    for name in names:
        root, _, _, overrides, _ = TYPOS[name]
        command = "train" if root == "train" else root
        processes[name] = subprocess.Popen(
            [sys.executable, "-m", "opd", command, "--config", str(write_config(tmp_path, name)), *overrides],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, process in processes.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == EXIT_USER_ERROR, stderr
        assert "Traceback" not in stderr
        assert stderr.startswith(f"opd: error: invalid config: {TYPOS[name][4]}; allowed keys here: "), stderr


NO_TORCH = """
import sys
from opd.cli import main

status = main(sys.argv[1:])
heavy = sorted(name for name in ("torch", "transformers", "numpy") if name in sys.modules)
print(status, heavy)
"""


@pytest.mark.parametrize(
    ("command", "typo"),
    [
        ("train", "nested"),
        ("plan", "nested"),
        ("eval", "nested"),
        ("train --dry-run", "nested"),
        ("eval --harness lm-eval --tasks gsm8k", "nested"),
        ("sft", "sft"),
        ("generate", "generate"),
    ],
)
def test_a_typo_is_refused_before_torch_is_imported(tmp_path, command, typo):
    """In a fresh process: the command returns status 2 having imported neither torch, transformers nor numpy."""
    path = write_config(tmp_path, typo)
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *command.split(), "--config", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.split("\n")[0] == f"{EXIT_USER_ERROR} []", result.stderr
    assert f"opd: error: invalid config: {TYPOS[typo][4]}" in result.stderr
