"""The shapes that ship with opd (``opd/models/shapes/``) and how a model path finds its config.

The dry run (``opd plan``) builds the specification's models from these files alone, so
they must be Qwen2.5's: the parameter counts below are those of the published models.
"""

from __future__ import annotations

import pytest
import torch
from opd_test_helpers import REPO_ROOT
from transformers import AutoModelForCausalLM

from opd.cli import main as opd_main
from opd.models.model_shapes import SHIPPED_TOKENIZER_SIZE, model_config, shipped_shapes, tokenizer_size
from opd.models.tiny import save_tiny_pair
from opd.utils.errors import ConfigError

PARAMETERS = {
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen/Qwen2.5-32B-Instruct": 32_763_876_352,
}


def test_the_shipped_shapes_are_qwen25s():
    assert shipped_shapes() == sorted(PARAMETERS)
    for name, count in PARAMETERS.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config(name))
        assert sum(parameter.numel() for parameter in model.parameters()) == count, name
        assert tokenizer_size(name) == SHIPPED_TOKENIZER_SIZE


def test_a_local_directory_and_a_tiny_preset_give_their_own_config(tmp_path):
    directory = save_tiny_pair(str(tmp_path / "tiny"), "student")
    assert model_config(directory).hidden_size == model_config("tiny:student").hidden_size == 64
    assert tokenizer_size(directory) == tokenizer_size("tiny:student")


def test_an_unknown_model_names_the_path_and_the_shipped_shapes():
    with pytest.raises(ConfigError, match=r"no config.json for model 'Qwen/Qwen9-1T'.*Qwen/Qwen2.5-32B-Instruct"):
        model_config("Qwen/Qwen9-1T")


def test_opd_plan_refuses_a_config_without_a_cluster_section(capsys):
    config = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
    assert opd_main(["plan", "--config", str(config)]) == 2
    assert "no cluster: section" in capsys.readouterr().err
