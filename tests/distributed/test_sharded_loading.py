"""Sharded loading: each trainer rank reads only its shards, and gets exactly the model's weights.

:func:`opd.distributed.sharded_loading.load_sharded` is what every trainer rank calls
(through :meth:`TrainerWorker.build`) for the student and a sharded colocated teacher.
Two claims, on real gloo process groups spawned with ``torch.multiprocessing``:

* **equal**: gathered back, the weights and buffers are bitwise those of the saved model
  (three ranks, so that shards are uneven and some ranks hold no rows of a tensor; a
  tied head stays tied, the rotary frequencies are computed, not left uninitialised);
* **memory**: two ranks loading a 240 MB model through the real ``TrainerWorker.build``
  grow their peak resident memory, summed over the ranks, by at most 1.6 × the model:
  at most one whole copy exists at any moment. Loading the whole model on every rank and
  then sharding (what the trainer did before) grows it by at least 2 ×.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM

from opd.distributed.fsdp import shard_model, whole_state_dict_buckets
from opd.distributed.sharded_loading import load_sharded
from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.tiny import build_tiny_model

BIG_MODEL_LIMIT = 1.6


def _gather_rank(rank: int, world: int, init_file: str, model_dirs: list[str], result_dir: str) -> None:
    """Loads each saved model sharded over the group and saves what this rank gathers back, one file per model."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for model_dir in model_dirs:
        model = load_sharded(
            model_dir, torch.float32, torch.device("cpu"), ModelLoadingConfig(), lambda m: shard_model(m, mesh)
        )
        weights = {name: tensor.clone() for bucket in whole_state_dict_buckets(model, 10**9) for name, tensor in bucket}
        buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        result = {"weights": weights, "buffers": buffers, "tied": tied}
        torch.save(result, Path(result_dir) / f"{Path(model_dir).name}_rank{rank}.pt")
    dist.destroy_process_group()


# (tied head, the file's dtype) of each saved model: a tied head, an untied head of its own values,
# and a bf16 file loaded into fp32 master weights.
SAVED_MODELS = {
    "tied_head": (True, torch.float32),
    "own_head": (False, torch.float32),
    "bf16_file_to_fp32_masters": (False, torch.bfloat16),
}


def _save_model(directory: Path, tied: bool, file_dtype: torch.dtype) -> torch.nn.Module:
    """Saves the tiny student (``tied`` head, ``file_dtype``) to ``directory``; returns the model expected back."""
    reference = build_tiny_model("student")
    if not tied:  # an untied head of its own values
        reference.config.tie_word_embeddings = False
        reference.lm_head.weight = torch.nn.Parameter(reference.lm_head.weight.detach().clone() * 0.5)
    saved = build_tiny_model("student")  # the same weights, in the file's dtype
    saved.config.tie_word_embeddings = tied
    if not tied:
        saved.lm_head.weight = torch.nn.Parameter(saved.lm_head.weight.detach().clone())
    saved.load_state_dict(reference.state_dict())
    saved.to(file_dtype).save_pretrained(directory)
    reference.load_state_dict({name: tensor.to(file_dtype).float() for name, tensor in reference.state_dict().items()})
    return reference


def test_sharded_loading_gives_the_saved_weights(tmp_path):
    # One process group of 3 ranks loads every saved model in turn: the ranks' start (a spawned
    # interpreter importing torch each) is paid once instead of once per model.
    references = {name: _save_model(tmp_path / name, *case) for name, case in SAVED_MODELS.items()}
    world = 3
    mp.spawn(
        _gather_rank,
        args=(world, str(tmp_path / "init"), [str(tmp_path / name) for name in SAVED_MODELS], str(tmp_path)),
        nprocs=world,
        join=True,
    )
    for name, reference in references.items():
        tied = SAVED_MODELS[name][0]
        expected = reference.state_dict()
        expected_buffers = dict(reference.named_buffers())
        for rank in range(world):
            result = torch.load(tmp_path / f"{name}_rank{rank}.pt", weights_only=False)
            assert result["tied"] is tied, name
            assert set(result["weights"]) <= set(expected), name
            for key, tensor in result["weights"].items():
                assert torch.equal(tensor, expected[key]), f"{name}, rank {rank}: {key} differs from the saved model"
            assert len(result["weights"]) == len(expected) - int(tied), name  # a tied head comes once
            for key, buffer in result["buffers"].items():
                assert torch.equal(buffer, expected_buffers[key]), f"{name}, rank {rank}: buffer {key} was not computed"


def test_a_file_that_lacks_a_parameter_is_named(tmp_path):
    build_tiny_model("student").save_pretrained(tmp_path / "model")
    from safetensors.torch import load_file, save_file

    file = tmp_path / "model" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with pytest.raises(Exception, match=r"lack 1 of the model's parameters \(first: model\.norm\.weight\)"):
            load_sharded(
                str(tmp_path / "model"),
                torch.float32,
                torch.device("cpu"),
                ModelLoadingConfig(),
                lambda m: shard_model(m, mesh),
            )
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- memory


def _resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _load_rank(rank: int, world: int, init_file: str, model_dir: str, result_dir: str) -> None:
    from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    spec = TrainerSpec(
        student_path=model_dir,
        teacher_path=None,
        loading=ModelLoadingConfig(dtype="float32", device="cpu"),
        optimizer=OptimizerConfig(),
        total_steps=1,
        backend="gloo",
        timeout_s=120,
        threads=1,
    )
    worker = TrainerWorker(rank, world, spec)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := resident memory now
    baseline = _resident_kib()
    worker.build(mesh, torch.device("cpu"))
    dist.barrier()
    grown = (_peak_kib() - baseline) * 1024
    Path(result_dir, f"rank{rank}.txt").write_text(str(grown))
    dist.destroy_process_group()


def test_a_hub_model_missing_from_this_nodes_cache_is_refused_naming_the_node(tmp_path, monkeypatch):
    """Not loaded whole on every rank (the whole model on each device, a download per rank): refused, naming the
    node and its cache. A hub model in the cache is read from its snapshot, slice by slice."""
    import socket

    from huggingface_hub import constants

    from opd.utils.errors import ConfigError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as refused:
        load_sharded("some-org/not-cached-anywhere", torch.float32, torch.device("cpu"), ModelLoadingConfig(),
                     lambda model: pytest.fail("nothing may load"))  # fmt: skip
    message = str(refused.value)
    assert socket.gethostname() in message and str(tmp_path / "empty-cache") in message
    assert "hf download some-org/not-cached-anywhere" in message

    # The same name once in the cache (the layout huggingface_hub writes): read from its snapshot.
    model = build_tiny_model("student")
    snapshot = tmp_path / "cache" / "models--some-org--tiny" / "snapshots" / "0123abcd"
    model.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        loaded = load_sharded(
            "some-org/tiny", torch.float32, torch.device("cpu"), ModelLoadingConfig(), lambda m: shard_model(m, mesh)
        )
        for name, weight in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name].full_tensor(), weight), name
    finally:
        dist.destroy_process_group()


def test_two_ranks_hold_at_most_one_copy_of_a_240_mb_model(tmp_path):
    config = Qwen2Config(
        vocab_size=32_000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes >= 200 * 2**20
    model.save_pretrained(tmp_path / "model")
    del model
    world = 2
    mp.spawn(
        _load_rank,
        args=(world, str(tmp_path / "init"), str(tmp_path / "model"), str(tmp_path)),
        nprocs=world,
        join=True,
    )
    grown = [int(Path(tmp_path, f"rank{rank}.txt").read_text()) for rank in range(world)]
    ratio = sum(grown) / model_bytes
    assert ratio <= BIG_MODEL_LIMIT, (
        f"the ranks' peak resident memory grew by {[g / 2**20 for g in grown]} MiB, {ratio:.2f} × the "
        f"{model_bytes / 2**20:.0f} MiB model; sharded loading holds at most {BIG_MODEL_LIMIT} ×"
    )
