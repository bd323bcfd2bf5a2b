"""HSDP (``cluster.trainer.shard_group_size``) trains exactly what plain FSDP2 and one process train.

Four real gloo ranks (``torch.multiprocessing``, no Ray) run the trainer's own code,
:class:`~opd.distributed.trainer_worker.TrainerWorker` built over the mesh that
:func:`opd.distributed.fsdp.init_process_group` returns, on the tiny student:

* with ``shard_group_size=2`` (the 2-D mesh ``("replicate", "shard")``: two groups of
  two ranks) and with the plain 1-D mesh over all four, three optimizer steps (SFT
  loss, clipped gradients, AdamW) give the losses, gradient norms and final weights of
  one in-process :class:`~opd.policy.hf_policy.HFPolicy`: the gradients are still
  *summed* over every rank, replicas included;
* the whole weights are gathered within a shard group only (every all-gather the gather
  runs is over 2 ranks), and bitwise equal what the ranks hold;
* a sharded checkpoint written by the HSDP ranks after step 2 loads back into freshly
  built HSDP ranks, and into plain FSDP2 ranks, whose step 3 equals the uninterrupted run's;
* a colocated teacher sharded over the HSDP mesh sends the in-process teacher's top-k;
* gradients are reduced once per step (``cluster.trainer.reduce_gradients: once_per_step``): with two
  micro-batches per rank, FSDP2 reduce-scatters each sharded module's gradients once per step, and HSDP
  all-reduces them across the groups once, counted on gloo; ``every_micro_batch`` does both twice.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opd_float_tolerance import adam_weight_tolerance, metric_tolerance, tiny_student_entries
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import shift_token_mask
from opd.distributed import fsdp
from opd.distributed.config import ClusterConfig
from opd.distributed.fsdp import device_mesh, init_process_group
from opd.distributed.fsdp_policy import FSDPPolicy
from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.distributed.workers.ray_cluster import free_port
from opd.losses.nll import NLLLossFn
from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import TopKRequest
from opd.models.loading import load_causal_lm
from opd.policy.hf_policy import HFPolicy
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.errors import ConfigError

WORLD = 4
GROUP = 2
STEPS = 3
MICRO_BATCH_SIZE = 2
LOADING = ModelLoadingConfig(dtype="float32", device="cpu")
# A learning rate that moves the weights, and a clipping bound every step hits.
OPTIMIZER = OptimizerConfig(learning_rate=1e-3, max_grad_norm=0.5, warmup_steps=0)
SUMMED_MICRO_BATCHES = 6
"""The most micro-batch gradients a run sums per step: 10 rows dealt 3/3/2/2 to four ranks, 2 rows each."""
# fp32 sums in another order (per rank, then over ranks) than one process's: bounds derived from the rounding.
WEIGHT_TOLERANCE = adam_weight_tolerance(OPTIMIZER.learning_rate, STEPS, SUMMED_MICRO_BATCHES, tiny_student_entries())


def metric_bound(step_index: int) -> float:
    """Relative: how far a step's loss or gradient norm may be from the other run's (step_index from 0)."""
    return metric_tolerance(step_index + 1, tiny_student_entries())


def batches() -> list[BatchedDataDict]:
    """Three global batches of 10 rows of different lengths (so ranks get uneven shares)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(4, 13, (10,), generator=generator)
        ids = torch.randint(3, 250, (10, 12), generator=generator)
        mask = torch.arange(12)[None, :] < lengths[:, None]
        token_mask = mask & (torch.arange(12)[None, :] >= 2)  # a two-token prompt carries no loss
        out.append(
            BatchedDataDict({"input_ids": ids * mask, "input_lengths": lengths, "token_mask": token_mask.long()})
        )
    return out


def scored_rows(rank: int) -> BatchedDataDict:
    """Two rows of this rank's own (the colocated teacher scores a rank's share)."""
    generator = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 250, (2, 8), generator=generator)
    lengths = torch.tensor([8, 8])
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, "token_mask": torch.ones_like(ids)})


def spec(teacher: bool = False, once_per_step: bool = True) -> TrainerSpec:
    return TrainerSpec(
        student_path="tiny:student",
        teacher_path="tiny:teacher" if teacher else None,
        loading=LOADING,
        optimizer=OPTIMIZER,
        total_steps=STEPS,
        backend="gloo",
        timeout_s=120.0,
        threads=1,
        reduce_gradients_once_per_step=once_per_step,
    )


def train_step(worker: TrainerWorker, data: BatchedDataDict, rank: int) -> dict[str, float]:
    """One step of this rank's share, planned as the controller plans it (:meth:`FSDPPolicy.plan`)."""
    planner = FSDPPolicy(types.SimpleNamespace(size=WORLD), MICRO_BATCH_SIZE, None, False)  # type: ignore[arg-type]
    plan = planner.plan(data)[rank]
    tokens = int(shift_token_mask(data["token_mask"]).sum())
    return worker.train(NLLLossFn(), tokens, data.size, plan, None)


GRADIENT_REDUCTIONS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
"""The collectives FSDP2 reduces gradients with (counted when its collectives module calls them)."""


@contextlib.contextmanager
def counted_gradient_reductions():
    """Counts, by name, the collectives FSDP2's gradient reduction issues while open."""
    counts: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(dist, name) for name in GRADIENT_REDUCTIONS}

    def counting(name: str, original):
        def collective(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith("_fsdp_collectives.py"):
                counts["reduce_scatter" if name.startswith("reduce_scatter") else name] += 1
            return original(*args, **kwargs)

        return collective

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def reductions_of_one_step(
    worker: TrainerWorker, data: BatchedDataDict, rank: int
) -> tuple[dict[str, float], dict[str, int]]:
    """One step's metrics, and its gradient collectives with the step's micro-batches and sharded modules here."""
    with counted_gradient_reductions() as counts:
        metrics = train_step(worker, data, rank)
    planner = FSDPPolicy(types.SimpleNamespace(size=WORLD), MICRO_BATCH_SIZE, None, False)  # type: ignore[arg-type]
    units = sum(isinstance(module, FSDPModule) for module in worker.model.modules())
    return metrics, {**counts, "micro_batches": len(planner.plan(data)[rank]), "units": units}


def recorded_gathers(worker: TrainerWorker) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Rank 0's whole weights, and the size of the group of every flat all-gather that made them."""
    sizes: list[int] = []
    original = dist.all_gather_single

    def recording(out, tensor, group=None, **kwargs):
        sizes.append(dist.get_world_size(group))
        return original(out, tensor, group=group, **kwargs)

    fsdp.dist.all_gather_single = recording  # type: ignore[attr-defined]
    try:
        return worker.whole_weights(), sizes
    finally:
        fsdp.dist.all_gather_single = original  # type: ignore[attr-defined]


def _rank(rank: int, port: int, result_dir: str) -> None:
    torch.set_num_threads(1)
    hsdp_mesh = init_process_group(rank, WORLD, "127.0.0.1", port, "gloo", 120.0, shard_group_size=GROUP)
    meshes = {"hsdp": hsdp_mesh, "fsdp": device_mesh("cpu", WORLD)}
    results: dict[str, object] = {"mesh_dims": hsdp_mesh.ndim, "mesh_names": hsdp_mesh.mesh_dim_names}
    data = batches()
    for label, mesh in meshes.items():
        worker = TrainerWorker(rank, WORLD, spec(teacher=label == "hsdp"))
        worker.build(mesh, torch.device("cpu"))
        if label == "hsdp":
            placements = {tuple(param.placements) for param in worker.model.parameters() if isinstance(param, DTensor)}
            results["hsdp_placements"] = placements
            # The colocated teacher, sharded over the same 2-D mesh, scores this rank's rows.
            results["teacher_topk"] = worker.teacher_score(TopKRequest(k=4), scored_rows(rank))
        # Step 1's gradient collectives, counted here and on a trainer that reduces after every micro-batch.
        every = TrainerWorker(rank, WORLD, spec(once_per_step=False))
        every.build(mesh, torch.device("cpu"))
        results[f"{label}_reductions_every_micro_batch"] = reductions_of_one_step(every, data[0], rank)[1]
        del every
        first, results[f"{label}_reductions"] = reductions_of_one_step(worker, data[0], rank)
        metrics = [first, *(train_step(worker, data[step], rank) for step in range(1, STEPS - 1))]
        if label == "hsdp":
            worker.save_shards(result_dir)
        metrics.append(train_step(worker, data[STEPS - 1], rank))
        weights, gather_sizes = recorded_gathers(worker)
        results[label] = {"metrics": metrics, "weights": weights, "gather_sizes": gather_sizes}
    # Fresh trainers, HSDP and plain FSDP2, resume from the HSDP checkpoint of step 2 and take step 3.
    for label, mesh in meshes.items():
        resumed = TrainerWorker(rank, WORLD, spec())
        resumed.build(mesh, torch.device("cpu"))
        resumed.load_shards(result_dir)
        metrics = [train_step(resumed, data[STEPS - 1], rank)]
        results[f"resumed_{label}"] = {"metrics": metrics, "weights": resumed.whole_weights()}
    torch.save(results, Path(result_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's results (rank 0's hold the gathered weights)."""
    directory = tmp_path_factory.mktemp("hsdp")
    mp.spawn(_rank, args=(free_port(), str(directory)), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def one_process():
    """The same three steps in one process: metrics and final weights."""
    torch.manual_seed(0)
    policy = HFPolicy(
        load_causal_lm("tiny:student", torch.float32, torch.device("cpu"), LOADING), OPTIMIZER, MICRO_BATCH_SIZE, STEPS
    )
    metrics = [policy.train(data, NLLLossFn()) for data in batches()]
    return metrics, {name: tensor.detach().clone() for name, tensor in policy.model.state_dict().items()}


def test_the_hsdp_mesh_is_two_dimensional(ranks):
    assert ranks[0]["mesh_dims"] == 2 and ranks[0]["mesh_names"] == ("replicate", "shard")
    assert ranks[0]["hsdp_placements"] == {(Replicate(), Shard(0))}


@pytest.mark.parametrize("label", ["hsdp", "fsdp"])
def test_four_ranks_match_one_process(ranks, one_process, label):
    expected_metrics, expected_weights = one_process
    for rank, results in enumerate(ranks):
        for step, (mine, reference) in enumerate(zip(results[label]["metrics"], expected_metrics, strict=True)):
            for key in ("loss", "grad_norm"):
                assert mine[key] == pytest.approx(reference[key], rel=metric_bound(step)), (rank, step, key)
            assert mine["grad_norm"] > OPTIMIZER.max_grad_norm  # clipping was at work
    weights = ranks[0][label]["weights"]
    assert weights.keys() <= expected_weights.keys() and weights
    initial = load_causal_lm("tiny:student", torch.float32, torch.device("cpu"), LOADING).state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected_weights[name], rtol=0, atol=WEIGHT_TOLERANCE, msg=name)
    assert max(float((initial[name] - weights[name]).abs().max()) for name in weights) > 5 * WEIGHT_TOLERANCE


@pytest.mark.parametrize("label", ["hsdp", "fsdp"])
def test_gradients_are_reduced_once_per_step(ranks, label):
    for results in ranks:
        once, every = results[f"{label}_reductions"], results[f"{label}_reductions_every_micro_batch"]
        assert once["micro_batches"] == every["micro_batches"] >= 2 and once["units"] >= 3
        assert once["reduce_scatter"] == once["units"]
        assert every["reduce_scatter"] == once["units"] * once["micro_batches"]
        # HSDP adds one all-reduce across the groups per reduce-scatter; plain FSDP2 none.
        replicas = once["reduce_scatter"] if label == "hsdp" else 0
        assert once.get("all_reduce", 0) == replicas
        assert every.get("all_reduce", 0) == replicas * once["micro_batches"]


def test_hsdp_gathers_whole_weights_within_a_shard_group(ranks):
    hsdp, fsdp_ = ranks[0]["hsdp"], ranks[0]["fsdp"]
    assert hsdp["gather_sizes"] and set(hsdp["gather_sizes"]) == {GROUP}
    assert set(fsdp_["gather_sizes"]) == {WORLD}
    for name, tensor in hsdp["weights"].items():
        torch.testing.assert_close(tensor, fsdp_["weights"][name], rtol=0, atol=WEIGHT_TOLERANCE, msg=name)


@pytest.mark.parametrize("label", ["hsdp", "fsdp"])
def test_an_hsdp_checkpoint_resumes_the_uninterrupted_run(ranks, label):
    """Into HSDP ranks as written, and into plain FSDP2 ranks (DCP reshards on load)."""
    for rank, results in enumerate(ranks):
        resumed, uninterrupted = results[f"resumed_{label}"]["metrics"][0], results["hsdp"]["metrics"][-1]
        for key in ("loss", "grad_norm"):
            assert resumed[key] == pytest.approx(uninterrupted[key], rel=metric_bound(STEPS - 1)), (rank, key)
    for name, tensor in ranks[0][f"resumed_{label}"]["weights"].items():
        torch.testing.assert_close(tensor, ranks[0]["hsdp"]["weights"][name], rtol=0, atol=WEIGHT_TOLERANCE, msg=name)


def test_a_colocated_teacher_on_the_hsdp_mesh_sends_the_in_process_signal(ranks):
    reference = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), LOADING))
    for rank, results in enumerate(ranks):
        rows = scored_rows(rank)
        expected, actual = reference.score(rows, TopKRequest(k=4)), results["teacher_topk"]
        assert torch.equal(actual.ids, expected.ids), rank
        torch.testing.assert_close(actual.logprobs, expected.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("workers", "group"), [(3, 2), (4, 3)])
def test_a_shard_group_size_that_does_not_divide_the_workers_is_refused(workers, group):
    with pytest.raises(ValueError, match=f"cluster.trainer.workers = {workers} is not a multiple of"):
        ClusterConfig.model_validate({"trainer": {"workers": workers, "shard_group_size": group}})


def test_the_config_error_names_the_key(tmp_path):
    from opd_test_helpers import REPO_ROOT

    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    with pytest.raises(ConfigError, match=r"cluster\.trainer\.shard_group_size"):
        load_config(
            MasterConfig,
            REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml",
            [f"output_dir={tmp_path}", "cluster.trainer.workers=3", "cluster.trainer.shard_group_size=2"],
        )
