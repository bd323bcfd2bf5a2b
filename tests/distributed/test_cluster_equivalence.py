"""The cluster path equals the in-process path: a real local Ray cluster, 2 FSDP2 workers over gloo.

* 10 steps of distillation (λ = 0.5: on-policy greedy rollouts from refit rollout
  workers, and fixed-data steps; the exact fused full-vocabulary loss with a colocated
  teacher; 2 micro-batches per rank) give the per-step losses and final weights of one
  process with the same global batch and seed, with FSDP2's defaults (the teacher
  sharded as well) and with the layers kept gathered to the backward and a whole
  teacher in each worker, within the float32 rounding that summing the micro-batches'
  gradients in another order allows (``opd_float_tolerance``);
* the colocated teacher and a teacher pool send the in-process teacher's signals (a pool's
  full vocabulary as hidden states alone);
* HF rollout workers, refit from the trainer, generate the in-process greedy rollouts.

One Ray cluster serves the module; every worker runs one thread (two shared cores).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from opd_float_tolerance import (
    METRIC_ZERO,
    adam_weight_tolerance,
    assert_weights_within,
    entries,
    metric_tolerance,
    tiny_student_entries,
)
from opd_test_helpers import REPO_ROOT, short_run_overrides
from safetensors.torch import load_file

from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.models.interfaces import (
    FullVocabRequest,
    StoredHiddenStates,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.loading import load_causal_lm
from opd.models.tiny import build_tiny_model
from opd.run.plotting import read_metrics
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.several_teachers import single_rows
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
STEPS = 6
LEARNING_RATE = 3e-3
MICRO_BATCHES = 4
"""Per step: 8 sequences in micro-batches of 2 (2 per rank on the cluster)."""


def equivalence_config(tmp_path: Path, name: str, *overrides: str) -> MasterConfig:
    """6 steps, on-policy (greedy) and fixed data by the λ = 0.5 coin; 8 sequences per step in micro-batches of 2."""
    return load_config(
        MasterConfig,
        TINY,
        [
            *short_run_overrides(tmp_path, name),
            f"training.max_num_steps={STEPS}",
            "training.batch_size=8",
            "training.micro_batch_size=2",
            f"training.learning_rate={LEARNING_RATE}",
            "training.save_freq=0",
            "distillation.lambda=0.5",
            "distillation.num_samples_per_prompt=1",
            "distillation.generate_strategy.decoding_method=greedy",
            "distillation.generate_strategy.max_length=12",
            *overrides,
        ],
    )


def train(config: MasterConfig) -> None:
    components = setup(config)
    try:
        distillation_train(components)
    finally:
        components.close()


CLUSTER_SETTINGS = {
    # FSDP2's defaults: layers gathered again for the backward, the teacher sharded too; the optimizer
    # state and the teacher offloaded around every rollout (nothing moves on CPU: the calls' order is checked).
    "sharded": ["cluster.trainer.offload_during_generation=true"],
    # Layers kept gathered from forward to backward, a whole teacher copy in each worker.
    "kept_whole": ["cluster.trainer.reshard_after_forward=false", "cluster.teacher.sharded=false"],
}


@pytest.fixture(scope="module")
def in_process_run(tmp_path_factory):
    config = equivalence_config(tmp_path_factory.mktemp("in_process"), "in_process")
    train(config)
    return Path(config.output_dir)


@pytest.fixture(scope="module", params=list(CLUSTER_SETTINGS))
def equivalence_runs(request, ray_cluster, tmp_path_factory, in_process_run):
    on_cluster = equivalence_config(
        tmp_path_factory.mktemp(request.param),
        "cluster",
        "cluster.trainer.workers=2",
        "cluster.rollout.workers=2",
        *CLUSTER_SETTINGS[request.param],
    )
    train(on_cluster)
    return in_process_run, Path(on_cluster.output_dir)


def test_two_fsdp_workers_match_one_process_step_by_step(equivalence_runs):
    in_process, on_cluster = (read_metrics(run / "logs") for run in equivalence_runs)
    expected = [record for record in in_process if "train/loss" in record]
    actual = [record for record in on_cluster if "train/loss" in record]
    assert [record["step"] for record in actual] == list(range(1, STEPS + 1))
    assert [record["train/on_policy"] for record in actual] == [record["train/on_policy"] for record in expected]
    assert 0 < sum(record["train/on_policy"] for record in actual) < STEPS  # both branches ran
    for mine, reference in zip(actual, expected, strict=True):
        tolerance = metric_tolerance(mine["step"], tiny_student_entries())
        for key in ("train/loss", "train/kl_forward", "train/grad_norm", "train/mean_response_length"):
            assert math.isclose(mine[key], reference[key], rel_tol=tolerance, abs_tol=METRIC_ZERO), (
                f"step {mine['step']} {key}: 2 workers {mine[key]!r}, one process {reference[key]!r}"
            )
    first_on_policy = next(record for record in actual if record["train/on_policy"])
    assert "timing/refit" in first_on_policy
    # The refit sends the student once, in the engines' fp32 (a tied head once), received by each of 2 workers.
    student_bytes = 4 * sum(parameter.numel() for parameter in build_tiny_model("student").parameters())
    assert first_on_policy["refit/bytes"] == student_bytes
    assert first_on_policy["refit/bytes_delivered"] == 2 * student_bytes


def test_two_fsdp_workers_end_with_the_weights_of_one_process(equivalence_runs):
    in_process, on_cluster = (load_file(str(run / "final_model" / "model.safetensors")) for run in equivalence_runs)
    tolerance = adam_weight_tolerance(LEARNING_RATE, STEPS, MICRO_BATCHES, entries(in_process))
    assert_weights_within(on_cluster, in_process, tolerance)
    initial = load_causal_lm("tiny:student", torch.float32, torch.device("cpu"), _loading())
    moved = max(float((initial.state_dict()[name] - in_process[name]).abs().max()) for name in in_process)
    assert moved > 5 * tolerance  # the comparison is not between two untrained students


# --------------------------------------------------------------------------- teacher signals and rollouts


@pytest.fixture(scope="module")
def cluster_components(ray_cluster, tmp_path_factory):
    """Two trainer workers with a colocated teacher and two rollout workers (nothing trained)."""
    config = equivalence_config(
        tmp_path_factory.mktemp("components"),
        "components",
        "cluster.trainer.workers=2",
        "cluster.rollout.workers=2",
        "training.warmup_steps=0",
    )
    components = setup(config)
    yield components
    components.close()


def scored_batch(size: int = 5) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 4, 7, 9, 2][:size])
    ids = torch.randint(3, 200, (size, 9), generator=generator)
    mask = torch.arange(9)[None, :] < lengths[:, None]
    return BatchedDataDict({"input_ids": ids * mask, "input_lengths": lengths, "token_mask": mask.long()})


def assert_same_signal(actual, expected, lengths) -> None:
    if isinstance(expected, TopKLogprobs):
        for row, length in enumerate(lengths.tolist()):
            assert torch.equal(actual.ids[row, :length], expected.ids[row, :length])
            torch.testing.assert_close(actual.logprobs[row, :length], expected.logprobs[row, :length], rtol=0, atol=1e-5)
            torch.testing.assert_close(
                actual.rest_logprobs[row, :length], expected.rest_logprobs[row, :length], rtol=0, atol=1e-5
            )
        return
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(actual[row, :length], expected[row, :length], rtol=0, atol=1e-5)


REQUESTS = [TopKRequest(k=5), TokenLogprobsRequest()]


@pytest.mark.parametrize("request_", REQUESTS, ids=["topk", "token_logprobs"])
def test_colocated_teacher_sends_the_in_process_signal(cluster_components, request_):
    batch = scored_batch()
    reference = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), _loading()))
    expected = reference.score(batch, request_)
    actual = cluster_components.teacher_policy.score(batch, request_)
    assert_same_signal(actual, expected, batch["input_lengths"])


def test_colocated_teacher_keeps_its_full_vocabulary_in_the_workers(cluster_components):
    # [B, L, V] would cross a process boundary: training and validation score in the workers instead.
    with pytest.raises(ValueError, match="stays in the trainer workers"):
        cluster_components.teacher_policy.score(scored_batch(), FullVocabRequest(prefer_hidden_states=True))


def test_teacher_pool_sends_the_in_process_signal(ray_cluster, tmp_path):
    from opd.distributed.teacher_pool import TeacherPool, TeacherWorker
    from opd.distributed.workers.ray_cluster import build_pools
    from opd.distributed.workers.worker_group import WorkerGroup

    cluster = equivalence_config(tmp_path, "pool", "cluster.teacher.placement=pool", "cluster.teacher.workers=2",
                                 "loss_fn.type=topk").cluster
    pools = build_pools(cluster, 0, 2)
    workers = WorkerGroup("teacher", TeacherWorker, pools.teacher, lambda rank: (rank, "tiny:teacher", _loading(), 1))
    try:
        batch = scored_batch()
        reference = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), _loading()))
        for request_ in REQUESTS:
            expected = reference.score(batch, request_)
            assert_same_signal(TeacherPool(workers).score(batch, request_), expected, batch["input_lengths"])
        # The full vocabulary: hidden states alone, where the trainer holds the output layer to bind them to.
        with pytest.raises(ValueError, match="teacher pool"):
            TeacherPool(workers).score(batch, FullVocabRequest())
        # They stay in the object store (two workers' blocks) until the rank that binds them fetches them.
        stored = TeacherPool(workers, binds_hidden_states=True).score(batch, FullVocabRequest())
        assert isinstance(stored, StoredHiddenStates) and len(stored.blocks) == 2
        expected_hidden = reference.get_hidden_states(batch).hidden_states
        assert_same_signal(stored.fetch().hidden_states, expected_hidden, batch["input_lengths"])
        # Rows taken on the way (a micro-batch of a batch scored ahead) are taken after the fetch.
        rows = torch.tensor([2, 0])
        taken = single_rows(stored, rows, 5)
        assert isinstance(taken, StoredHiddenStates)
        assert torch.equal(taken.fetch().hidden_states, stored.fetch().hidden_states[rows, :5])
    finally:
        workers.kill()
        pools.remove()


def test_rollout_workers_refit_from_the_trainer_generate_the_in_process_greedy_rollouts(cluster_components):
    from opd.data.batches import build_fixed_data_batch
    from opd.losses.nll import NLLLossFn
    from opd.rollout.hf_generation import HFGeneration

    config = cluster_components.master_config
    examples = next(iter(cluster_components.dataloader))
    prompts = [example["prompt_ids"] for example in examples[:5]]
    # One SFT step moves the trainer's weights away from the rollout workers' starting point.
    policy = cluster_components.student_policy
    policy.train(build_fixed_data_batch(examples, cluster_components.tokenizer.pad_token_id, True), NLLLossFn())
    weights = dict(policy.weights_for_refit())
    student = load_causal_lm("tiny:student", torch.float32, torch.device("cpu"), _loading())
    assert max(float((student.state_dict()[name] - tensor).abs().max()) for name, tensor in weights.items()) > 1e-4
    cluster_components.student_generation.refit(policy)
    strategy = config.distillation.generate_strategy
    actual = cluster_components.student_generation.generate(prompts, strategy, 1, return_logprobs=True)
    student.load_state_dict(weights, strict=False)
    engine = HFGeneration(student, cluster_components.tokenizer, config.generation.decode_loop)
    engine.prepare_for_generation()
    expected = engine.generate(prompts, strategy, 1, return_logprobs=True)
    assert actual["input_lengths"].tolist() == expected["input_lengths"].tolist()
    for row, length in enumerate(expected["input_lengths"].tolist()):
        assert actual["input_ids"][row, :length].tolist() == expected["input_ids"][row, :length].tolist()
    torch.testing.assert_close(actual["generation_logprobs"][:, : expected["generation_logprobs"].shape[1]],
                               expected["generation_logprobs"], rtol=0, atol=1e-5)


def _loading():
    from opd.models.config import ModelLoadingConfig

    return ModelLoadingConfig(dtype="float32", device="cpu")


def test_a_bf16_cluster_run_computes_in_bf16_on_fp32_master_weights(ray_cluster, tmp_path):
    """FSDP2 mixed precision: bf16 forward/backward, fp32 shards and reductions, the final model in bf16."""
    import torch.distributed.checkpoint as dcp

    fixed_data = ["distillation.lambda=0.0", "training.max_num_steps=3", "training.save_freq=3"]
    reference = equivalence_config(tmp_path, "fp32", *fixed_data)
    bf16 = equivalence_config(
        tmp_path, "bf16", *fixed_data, "model.dtype=bfloat16", "cluster.trainer.workers=2", "cluster.rollout.workers=1"
    )
    train(reference)
    train(bf16)
    expected, actual = (
        [record["train/loss"] for record in read_metrics(Path(config.output_dir) / "logs") if "train/loss" in record]
        for config in (reference, bf16)
    )
    assert len(actual) == 3
    for mine, fp32 in zip(actual, expected, strict=True):
        assert mine != fp32  # computed in bf16 ...
        assert math.isclose(mine, fp32, rel_tol=2e-2)  # ... close to fp32
    shards = Path(bf16.output_dir) / "checkpoints" / "step_3" / "policy_shards"
    stored = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    assert stored["model.model.norm.weight"].properties.dtype == torch.float32
    final = load_file(str(Path(bf16.output_dir) / "final_model" / "model.safetensors"))
    assert {tensor.dtype for tensor in final.values()} == {torch.bfloat16}
