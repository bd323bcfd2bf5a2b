"""The ``generation`` section: backend choice and the vLLM settings, checked before any model loads."""

from __future__ import annotations

import re
import sys

import pytest
from opd_test_helpers import REPO_ROOT

from opd.distillation.config import MasterConfig
from opd.distillation.setup import check_environment
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

CONFIGS = REPO_ROOT / "examples" / "configs"


def test_the_served_math_variant_is_a_valid_remote_teacher_vllm_config(monkeypatch):
    monkeypatch.setenv("OPD_TEACHER_KEY", "token")  # the file names this variable for the bearer token
    monkeypatch.setitem(sys.modules, "vllm", type(sys)("vllm"))  # an importable stand-in
    # Loading validates the teacher / loss / generation combination (MasterConfig's cross-section checks).
    config = load_config(MasterConfig, CONFIGS / "distillation_math_served.yaml", [])
    assert config.generation.backend == "vllm"
    assert config.teacher.backend == "remote" and config.model.teacher_model_path is None
    assert config.loss_fn.type == "topk"
    # the client may ask for no more candidates than the server command in the file allows
    assert f"--max-logprobs {config.loss_fn.k}" in (CONFIGS / "distillation_math_served.yaml").read_text()
    check_environment(config)  # the API key variable is set, vLLM importable
    # the engine must fit the longest prompt plus the longest response
    assert config.generation.vllm.max_model_len >= (
        config.data.max_prompt_length + config.distillation.generate_strategy.max_length
    )


def test_vllm_backend_without_vllm_names_the_key_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    config = load_config(MasterConfig, CONFIGS / "demo.yaml", ["generation.backend=vllm"])
    with pytest.raises(ConfigError, match=re.escape("generation.backend = vllm needs the vllm package")):
        check_environment(config)


def test_a_max_model_len_without_room_for_the_response_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", type(sys)("vllm"))  # an importable stand-in
    with pytest.raises(ConfigError, match=re.escape("generation.vllm.max_model_len = 96 leaves no room")):
        load_config(MasterConfig, CONFIGS / "demo.yaml", [
            "generation.backend=vllm", "generation.vllm.max_model_len=96",
            "distillation.generate_strategy.max_length=96",
        ])


@pytest.mark.parametrize("override, key", [
    ("generation.backend=sglang", "generation.backend"),
    ("generation.vllm.gpu_memory_utilization=1.5", "generation.vllm.gpu_memory_utilization"),
    ("generation.vllm.enable_sleep_mode=maybe", "generation.vllm.enable_sleep_mode"),
    ("generation.vllm.tensor_parallel=2", "generation.vllm.tensor_parallel"),
])
def test_bad_generation_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(MasterConfig, CONFIGS / "demo.yaml", [override])
