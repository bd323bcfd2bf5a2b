"""A LoRA student on a cluster: 2 FSDP2 trainer workers with peft adapters, against one process.

* 2 steps of on-policy distillation (greedy rollouts from a refit HF rollout worker, the
  exact fused loss with a colocated teacher; the student read from safetensors files,
  each rank its own slices) give the in-process LoRA run's losses, its
  adapter and its merged final model, within float32 rounding as derived in
  ``opd_float_tolerance`` (the two ranks add the micro-batches' gradients in another order,
  which Adam turns into up to ``lr`` times the gradient's relative error per step): the
  adapters start from the same seeded draw, only they train, and the rollout worker is
  refit with the merged weights under the base model's names (step 2 samples from them);
* the checkpoints hold the adapters and their optimizer state only (the frozen base is
  the starting model); loaded back into the workers and saved again they are the same
  bit for bit, and a run resumed from step 1's checkpoint ends as the
  uninterrupted one.

One Ray cluster serves the module; every worker runs one thread.
"""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from opd_float_tolerance import (
    EPS32,
    METRIC_ZERO,
    adam_weight_tolerance,
    assert_weights_within,
    entries,
    metric_tolerance,
    tiny_student_entries,
)
from opd_test_helpers import REPO_ROOT, short_run_overrides
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.tiny import build_tiny_model
from opd.run.checkpoint_export import export_checkpoint
from opd.run.plotting import read_metrics
from opd.utils.config import load_config
from opd.utils.errors import OpdError

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
STEPS = 2
LEARNING_RATE = 1e-3
MICRO_BATCHES = 4
"""Per step: a batch of 4 in micro-batches of 1 (2 per rank on the cluster)."""
LORA_ALPHA = 8
ADAPTER = "adapter/adapter_model.safetensors"


def lora_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    """2 on-policy steps of 4 greedy rollouts in micro-batches of 2, a rank-4 adapter without dropout."""
    return load_config(
        MasterConfig,
        TINY,
        [
            *short_run_overrides(tmp_path),
            f"training.max_num_steps={STEPS}",
            "training.batch_size=4",
            "training.micro_batch_size=1",
            "training.warmup_steps=0",
            f"training.learning_rate={LEARNING_RATE}",
            "training.save_freq=1",
            "checkpointing.keep_top_k=null",
            "distillation.lambda=1.0",
            "distillation.num_samples_per_prompt=1",
            "distillation.generate_strategy.decoding_method=greedy",
            "distillation.generate_strategy.max_length=8",
            "model.lora.r=4",
            f"model.lora.alpha={LORA_ALPHA}",
            *overrides,
        ],
    )


def train(config: MasterConfig) -> None:
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()


# The broadcast refit (gloo here) sends the buckets of a layout made on trainer rank 0 alone.
CLUSTER = ["cluster.trainer.workers=2", "cluster.rollout.workers=1", "cluster.rollout.refit_transport=broadcast"]


ROUND_TRIP = "round_trip"
"""Where the cluster run's workers, having loaded step 1's checkpoint after the run, save it again."""


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """The in-process LoRA run and the same run on 2 FSDP2 workers (with a checkpoint each step).

    After its last step the rollout worker is refit once more (its weights and the
    student's merged weights are returned), then the cluster's student loads step 1's
    checkpoint and saves it to ``ROUND_TRIP`` in its run directory.
    """
    # A directory of safetensors files: each rank reads only its slices of the base weights.
    student = tmp_path_factory.mktemp("student") / "model"
    build_tiny_model("student").save_pretrained(student)
    from_directory = [f"model.student_model_path={student}", "model.tokenizer_path=tiny:student"]
    in_process = lora_config(tmp_path_factory.mktemp("in_process"), *from_directory)
    train(in_process)
    on_cluster = lora_config(tmp_path_factory.mktemp("cluster"), *from_directory, *CLUSTER)
    components = setup(on_cluster)
    try:
        distillation_train(components)
        output_dir = Path(on_cluster.output_dir)
        policy, engines = components.student_policy, components.student_generation
        engines.refit(policy)
        refit = {"engine": engines.workers.run_rank(0, "weights"), "merged": dict(policy.weights_for_refit())}
        components.student_policy.load_checkpoint(output_dir / "checkpoints" / "step_1")
        components.student_policy.save_checkpoint(output_dir / ROUND_TRIP)
    finally:
        components.close()
    return in_process, on_cluster, refit


def losses(config: MasterConfig) -> list[float]:
    records = [record for record in read_metrics(Path(config.output_dir) / "logs") if "train/loss" in record]
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    return [record["train/loss"] for record in records]


def final(config: MasterConfig, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(config.output_dir) / "final_model" / name))


def adapter_tolerance(adapter: dict[str, torch.Tensor]) -> float:
    """How far an adapter entry may end from the other run's: ``opd_float_tolerance.adam_weight_tolerance``.

    Not relative to the tensor's largest entry: every entry of a lora_B (zero at the start)
    moves by about ``lr`` per step, and one whose gradient is near zero moves by up to
    ``lr`` times its gradient's relative rounding, however small the tensor (1e-5 of a
    lora_B's largest entry, fitted to one machine, failed on another CPU by 2.35e-8
    against 2.0e-8).
    """
    return adam_weight_tolerance(LEARNING_RATE, STEPS, MICRO_BATCHES, entries(adapter))


def merged_tolerance(adapter: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> float:
    """The adapters' tolerance carried into ``W + (alpha / r) * B @ A``.

    ``(B + dB)(A + dA) - BA`` sums ``r`` products ``dB * A + B * dA`` per entry: at most
    ``alpha * tolerance * (max|A| + max|B|)``, plus the merge's own rounding of ``W``.
    """
    largest = {kind: max(float(t.abs().max()) for name, t in adapter.items() if kind in name)
               for kind in ("lora_A", "lora_B")}
    weights = max(float(tensor.abs().max()) for tensor in merged.values())
    return LORA_ALPHA * adapter_tolerance(adapter) * (largest["lora_A"] + largest["lora_B"]) + EPS32 * weights


def assert_losses_match(actual: list[float], expected: list[float]) -> None:
    for step, (mine, reference) in enumerate(zip(actual, expected, strict=True), start=1):
        tolerance = metric_tolerance(step, tiny_student_entries())
        assert math.isclose(mine, reference, rel_tol=tolerance, abs_tol=METRIC_ZERO), (step, mine, reference)


def test_two_fsdp_workers_train_the_adapter_of_one_process(runs):
    in_process, on_cluster, _ = runs
    assert_losses_match(losses(on_cluster), losses(in_process))
    adapter = final(on_cluster, ADAPTER)
    assert_weights_within(adapter, final(in_process, ADAPTER), adapter_tolerance(adapter), "the adapters")
    # Every lora_B starts at zero: the comparison is between trained adapters, far apart from zero.
    assert min(float(tensor.abs().max()) for name, tensor in adapter.items() if "lora_B" in name) > (
        10 * adapter_tolerance(adapter))


def test_the_cluster_final_model_is_the_merged_plain_model_of_one_process(runs):
    in_process, on_cluster, _ = runs
    merged = final(on_cluster, "model.safetensors")
    assert not any("lora" in name or "base_layer" in name for name in merged)
    tolerance = merged_tolerance(final(on_cluster, ADAPTER), merged)
    assert_weights_within(merged, final(in_process, "model.safetensors"), tolerance, "the merged models")
    base = build_tiny_model("student").state_dict()
    assert max(float((merged[name] - base[name]).abs().max()) for name in merged) > 1e-5


def test_the_rollout_worker_is_refit_with_the_merged_weights_under_the_base_names(runs):
    _, _, refit = runs
    engine, merged = refit["engine"], refit["merged"]
    base = build_tiny_model("student").state_dict()
    assert merged.keys() <= base.keys() and not any("lora" in name or "base_layer" in name for name in merged)
    assert [name for name in merged if not torch.equal(engine[name], merged[name])] == []
    assert max(float((merged[name] - base[name]).abs().max()) for name in merged) > 1e-5


def stored_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's ``policy_shards/``, read whole in this process."""
    reader = dcp.FileSystemReader(str(checkpoint / "policy_shards"))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_a_cluster_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_and_loads_back(runs, tmp_path):
    _, on_cluster, _ = runs
    checkpoints = Path(on_cluster.checkpointing.checkpoint_dir)
    step_1 = stored_tensors(checkpoints / "step_1")
    weights = {name for name in step_1 if name.startswith("model.")}
    # The adapters alone: no frozen base weight, nor the head tied to the embedding.
    assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights)
    assert any(name.startswith("optimizer.state.") and name.endswith(".exp_avg_sq") for name in step_1)
    step_2 = stored_tensors(checkpoints / "step_2")
    assert any(not torch.equal(step_1[name], step_2[name]) for name in weights)
    # Loaded into the trained workers (which hold step 2's state) and saved again: step 1's, bit for bit.
    round_trip = stored_tensors(Path(on_cluster.output_dir) / ROUND_TRIP)
    assert round_trip.keys() == step_1.keys()
    assert [name for name in step_1 if not torch.equal(round_trip[name], step_1[name])] == []
    # Without base weights the checkpoint cannot be exported to a model directory: refused, saying why.
    with pytest.raises(OpdError, match=r"holds a LoRA student's adapters only.*final_model/"):
        export_checkpoint(checkpoints / "step_1", tmp_path / "exported")


# Not `slow`: the slow tier would build the module's runs again for this one resume (two runs and a
# cluster's workers); here it reuses them. Last in the file: it rewrites the cluster run's directory.
def test_a_cluster_lora_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(runs, tmp_path):
    _, on_cluster, _ = runs
    checkpoints = Path(on_cluster.checkpointing.checkpoint_dir)
    expected_losses, expected_adapter = losses(on_cluster), final(on_cluster, ADAPTER)
    # The run as if killed after step 1's checkpoint.
    shutil.rmtree(checkpoints / "step_2")
    shutil.move(Path(on_cluster.output_dir) / "final_model", tmp_path / "uninterrupted_final_model")
    train(on_cluster)
    assert_losses_match(losses(on_cluster), expected_losses)
    adapter = final(on_cluster, ADAPTER)
    assert_weights_within(adapter, expected_adapter, adapter_tolerance(adapter), "the resumed run's adapters")
