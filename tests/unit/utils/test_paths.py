"""Paths are absolute in the controller before they reach a worker; a model directory is checked whole.

* :func:`absolute_model_path` makes a local model directory absolute and leaves hub names
  and ``tiny:`` presets alone;
* what the cluster's workers are given (:class:`ClusterRequest`) is absolute;
* a checkpoint manager made in one working directory finds its checkpoints from another;
* :func:`check_model_directory` accepts a complete model directory and names what a
  partial one lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.rollout.engines import GenerationConfig
from opd.run.checkpoint import CheckpointingConfig, CheckpointManager, check_model_directory
from opd.utils.errors import OpdError
from opd.utils.paths import absolute_dir, absolute_model_path


def test_local_model_directories_become_absolute_and_names_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "student").mkdir(parents=True)
    assert absolute_model_path("models/student") == str(tmp_path / "models" / "student")
    assert absolute_model_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"
    assert absolute_model_path("tiny:student") == "tiny:student"
    assert absolute_dir("run/checkpoints") == tmp_path / "run" / "checkpoints"


def test_the_cluster_request_carries_absolute_paths(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from opd.distributed.setup import ClusterRequest

    monkeypatch.chdir(tmp_path)
    for name in ("student", "teacher"):
        (tmp_path / "models" / name).mkdir(parents=True)
    request = ClusterRequest(
        student_path="models/student",
        teacher_paths={"teacher": "models/teacher", "teacher b": "tiny:teacher"},
        loading=ModelLoadingConfig(),
        optimizer=OptimizerConfig(),
        total_steps=1,
        micro_batch_size=1,
        micro_batch_tokens=None,
        sequence_packing=False,
        tokenizer=None,
        generation=GenerationConfig(),
        checkpoint_dir="run/checkpoints",
    )
    assert request.student_path == str(tmp_path / "models" / "student")
    assert request.teacher_paths == {"teacher": str(tmp_path / "models" / "teacher"), "teacher b": "tiny:teacher"}
    assert request.checkpoint_dir == str(tmp_path / "run" / "checkpoints")


def test_a_checkpoint_manager_finds_its_checkpoints_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir="run/checkpoints"))
    step = tmp_path / "run" / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "save_state.json").write_text("{}", encoding="utf-8")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert manager.root.is_absolute()
    assert manager.latest_checkpoint() == step


def test_a_complete_model_directory_passes_and_a_partial_one_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_directory(tmp_path, "trainer rank 0")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text("{}", encoding="utf-8")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(OpdError, match=r"model-00002-of-00002\.safetensors missing"):
        check_model_directory(sharded, "trainer rank 0")
    with pytest.raises(OpdError, match=r"trainer rank 0 to '.*empty' .* config.json, the weights"):
        check_model_directory(Path(tmp_path / "empty"), "trainer rank 0")
