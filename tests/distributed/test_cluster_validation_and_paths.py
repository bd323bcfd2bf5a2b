"""On a real 2-rank cluster: validation's KL where the logits are, absolute paths, a shared checkpoint directory.

* The KL sums of 2 FSDP2 ranks (colocated teacher, full vocabulary and top-k; top-k sent
  from the controller) equal the float64 KL of one process's whole logits.
* A whole validation pass returns no tensor with a vocabulary's width to the controller
  (every result of every worker group is inspected); its bytes are printed.
* The run is started from another working directory than the Ray workers', with a
  relative ``output_dir``: the ranks write checkpoint shards and ``final_model/`` where
  the controller reads them.
* Setup checks that every rank's marker reaches the checkpoint directory; a rank whose
  view of that directory is another disk (a node-local path) stops the check with an
  error naming the directory and that rank's node; ``final_model/`` written where the
  controller cannot read it fails likewise.

One Ray cluster serves the module; every worker runs one thread.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import build_token_mask, model_inputs, shift_token_mask
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distributed.fsdp_policy import FSDPPolicy
from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.distributed.workers.shared_directory import check_shared_directory
from opd.distributed.workers.worker_group import Slot, WorkerGroup
from opd.losses.divergences import token_kl, topk_token_kl
from opd.models.config import ModelLoadingConfig, OptimizerConfig
from opd.models.interfaces import AnsweredWhereTrained, FullVocabRequest, TopKRequest
from opd.models.loading import load_causal_lm
from opd.run.validation import ValidationKL, validate
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, OpdError

# Not from opd_test_helpers: a Ray worker imports this module (for NodeLocalTrainerWorker)
# without the tests directory on its path.
REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TINY_TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
VAL_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "val.jsonl"


def cluster_config(output_dir: str, *overrides: str) -> MasterConfig:
    """2 trainer ranks with the teacher colocated, 1 rollout worker, 4 validation prompts in batches of 2."""
    return load_config(
        MasterConfig,
        TINY,
        [
            f"output_dir={output_dir}",
            f"data.train_path={TINY_TRAIN_DATA}",
            f"data.val_path={VAL_DATA}",
            "data.max_val_examples=4",
            "validation.batch_size=2",
            "validation.generate_strategy.max_length=10",
            "validation.val_at_start=false",
            "validation.val_at_end=false",
            "logger.console=false",
            "training.batch_size=4",
            "training.micro_batch_size=2",
            "cluster.trainer.workers=2",
            "cluster.rollout.workers=1",
            *overrides,
        ],
    )


# --------------------------------------------------------------------------- a node-local checkpoint directory


class NodeLocalTrainerWorker(TrainerWorker):
    """A trainer whose rank 1 sees another disk at the checkpoint directory's path (a node-local directory)."""

    def _own_view(self, directory: str) -> str:
        return directory + "_rank1_local_disk" if self.rank == 1 else directory

    def write_marker(self, directory: str, token: str):
        return super().write_marker(self._own_view(directory), token)

    def remove_marker(self, directory: str, token: str) -> None:
        super().remove_marker(self._own_view(directory), token)


def test_a_marker_write_that_fails_is_reported_and_a_relative_directory_is_refused(tmp_path, monkeypatch):
    """The marker logic alone, without Ray: an OSError comes back as the tuple's error; a relative path raises."""
    worker = object.__new__(TrainerWorker)  # the constructor only sets torch's thread count, which this leaves alone
    worker.rank, worker.world_size = 1, 2
    monkeypatch.setattr(worker, "node_name", lambda: "host/10.0.0.2")
    name, node, error = worker.write_marker(str(tmp_path / "shared"), "token")
    assert error is None and node == "host/10.0.0.2"
    assert (tmp_path / "shared" / name).read_text(encoding="utf-8") == "rank 1 of 2 on host/10.0.0.2\n"
    (tmp_path / "a file").write_text("", encoding="utf-8")
    name, node, error = worker.write_marker(str(tmp_path / "a file" / "checkpoints"), "token")
    assert error is not None and error.startswith(("FileExistsError", "NotADirectoryError")), error
    with pytest.raises(ValueError, match="must send an absolute checkpoint directory, got 'run/checkpoints'"):
        worker.write_marker("run/checkpoints", "token")


def test_a_checkpoint_directory_that_one_node_does_not_share_stops_the_run(ray_cluster, tmp_path):
    # Two real trainer actors (their constructors load nothing; the markers need no model).
    spec = TrainerSpec("tiny:student", None, ModelLoadingConfig(), OptimizerConfig(), 1, "gloo", 60.0, 1)
    pool = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
    ray.get(pool.ready())
    workers = WorkerGroup(
        "trainer", NodeLocalTrainerWorker, [Slot(pool, index, 0.5, 0.0) for index in range(2)], lambda r: (r, 2, spec)
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    try:
        with pytest.raises(ConfigError) as raised:
            check_shared_directory(workers, checkpoints)
    finally:
        workers.kill()
        remove_placement_group(pool)
    message = str(raised.value)
    assert f"'{checkpoints}'" in message and "filesystem every node shares" in message
    assert "rank 1 on node" in message and "rank 0" not in message
    # The markers are gone, from the shared directory and from rank 1's own disk.
    assert not list(checkpoints.iterdir()) and not list(Path(f"{checkpoints}_rank1_local_disk").iterdir())


# --------------------------------------------------------------------------- the normal run, from another directory


@pytest.fixture(scope="module")
def components(ray_cluster, tmp_path_factory):
    """The cluster's backends, set up from a working directory other than the workers', with relative paths."""
    import opd.distributed.setup as cluster_setup

    workdir = tmp_path_factory.mktemp("elsewhere")
    started_in = Path.cwd()
    checked: list[Path] = []
    check = cluster_setup.check_shared_directory

    def spy(workers: WorkerGroup, directory: Path) -> None:
        checked.append(directory)
        check(workers, directory)

    cluster_setup.check_shared_directory = spy
    os.chdir(workdir)  # the Ray workers stay in the directory they started in
    try:
        built = setup(cluster_config("run"))  # output_dir and checkpoint_dir relative
    finally:
        cluster_setup.check_shared_directory = check
    try:
        # Every rank's marker was seen in the (absolute) checkpoint directory, then removed.
        assert checked == [workdir / "run" / "checkpoints"] and not list(checked[0].iterdir())
        yield workdir, built
    finally:
        built.close()
        os.chdir(started_in)


def test_ranks_write_shards_and_final_model_where_the_controller_reads(components):
    workdir, built = components
    policy = built.student_policy
    policy.save_checkpoint(Path("run") / "manual_checkpoint")  # relative, as the driver may pass it
    assert (workdir / "run" / "manual_checkpoint" / "policy_shards" / ".metadata").is_file()
    policy.save_pretrained("run/manual_final")
    assert (workdir / "run" / "manual_final" / "config.json").is_file()
    assert Path(built.checkpointer.root) == workdir / "run" / "checkpoints"  # absolute in the controller


class ElsewhereForRankZero:
    """The trainer group, but rank 0 writes ``save_pretrained`` to another directory (a disk the controller lacks)."""

    def __init__(self, group: WorkerGroup, elsewhere: Path) -> None:
        self.group, self.elsewhere, self.size = group, elsewhere, group.size

    def call(self, method: str, *args: Any, shares=None) -> Any:
        if method == "save_pretrained":
            args = (str(self.elsewhere),)
        return self.group.call(method, *args, shares=shares)


def test_a_final_model_the_controller_cannot_read_fails_clearly(components, tmp_path):
    _, built = components
    policy = FSDPPolicy(
        ElsewhereForRankZero(built.student_policy.workers, tmp_path / "node_local"), 2, None, False
    )
    expected = tmp_path / "final_model"
    with pytest.raises(OpdError, match=r"config.json, the weights .* missing. output_dir must be on a filesystem"):
        policy.save_pretrained(str(expected))
    assert (tmp_path / "node_local" / "config.json").is_file()  # it was written, elsewhere


# --------------------------------------------------------------------------- validation's KL on the cluster


def fixed_batch() -> BatchedDataDict:
    generator = torch.Generator().manual_seed(7)
    lengths, prompts = torch.tensor([9, 4, 7, 9, 6]), torch.tensor([3, 2, 2, 4, 1])
    ids = torch.randint(3, 200, (5, 9), generator=generator) * (torch.arange(9)[None, :] < lengths[:, None])
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "prompt_lengths": prompts,
            "token_mask": build_token_mask(lengths, prompts, 9, True),
        }
    )


def one_process_sums(batch: BatchedDataDict, request, vocab: int) -> dict[str, float]:
    """Validation's KL from one process's whole logits, in float64 (the computation made before)."""
    loading = ModelLoadingConfig(dtype="float32", device="cpu")
    student = load_causal_lm("tiny:student", torch.float32, torch.device("cpu"), loading)
    teacher = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), loading))
    with torch.no_grad():
        student_logits = student(**model_inputs(batch, "cpu"), use_cache=False).logits.double()
    mask = shift_token_mask(batch["token_mask"]).bool()
    rows = student_logits[:, :-1][..., :vocab][mask]
    answer = teacher.score(batch, request)
    sums = {"tokens": float(mask.sum())}
    for direction in ("forward", "reverse"):
        if isinstance(request, TopKRequest):
            kl = topk_token_kl(
                rows,
                answer.logprobs[:, :-1][mask].double(),
                answer.ids[:, :-1][mask],
                direction,
                teacher_rest_logprobs=answer.rest_logprobs[:, :-1][mask].double(),
            )
        else:
            kl = token_kl(rows, answer.double()[..., :vocab][:, :-1][mask], direction)
        sums[f"kl_{direction}"] = float(kl.sum())
    return sums




@pytest.mark.parametrize(
    ("request_", "teacher_in_workers"),
    [(FullVocabRequest(), True), (TopKRequest(6, 1.0, 200), True), (TopKRequest(6, 1.0, 200), False)],
    ids=["full_vocab_colocated", "topk_colocated", "topk_from_the_controller"],
)
def test_two_ranks_sum_the_kl_of_one_process(components, request_, teacher_in_workers):
    _, built = components
    batch, vocab = fixed_batch(), 200
    policy = FSDPPolicy(built.student_policy.workers, 2, None, False)
    if teacher_in_workers:  # the driver's facade of the colocated teacher: each worker scores its own rows
        teacher_signal = lambda rows: AnsweredWhereTrained(request_)  # noqa: E731
    else:
        loading = ModelLoadingConfig(dtype="float32", device="cpu")
        local = LocalTeacher(load_causal_lm("tiny:teacher", torch.float32, torch.device("cpu"), loading))
        teacher_signal = lambda rows: local.score(rows, request_)  # noqa: E731
    actual = policy.compare_with_teacher(batch, ValidationKL(request_, vocab), teacher_signal)
    expected = one_process_sums(batch, request_, vocab)
    assert actual["tokens"] == expected["tokens"]
    for key in ("kl_forward", "kl_reverse"):
        # Two ranks' sums against one process's: one step's rounding (opd_float_tolerance.metric_tolerance).
        # Imported here: the Ray workers import this module (its actor class) without the tests' sys.path.
        from opd_float_tolerance import metric_tolerance, tiny_student_entries

        assert actual[key] == pytest.approx(expected[key], rel=metric_tolerance(1, tiny_student_entries())), key


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a worker's result (nested containers, dataclass-like objects)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if hasattr(value, "__dict__"):
        return tensors_in(vars(value))
    return []


def test_a_validation_pass_returns_no_vocabulary_wide_tensor_to_the_controller(components, monkeypatch):
    _, built = components
    received: list[tuple[str, int, list[torch.Size]]] = []
    gather = WorkerGroup.gather

    def recording_gather(self, refs, *args, **kwargs):
        results = gather(self, refs, *args, **kwargs)
        for result in results:
            received.append((self.role, len(pickle.dumps(result)), [t.shape for t in tensors_in(result)]))
        return results

    monkeypatch.setattr(WorkerGroup, "gather", recording_gather)
    config = built.master_config
    metrics = validate(
        built.student_generation,
        built.student_policy,
        built.teacher_policy,
        built.val_dataloader,
        built.tokenizer,
        config.validation.generate_strategy,
        config.validation.teacher_topk,
        loss_request=built.loss_fn.teacher_request,
    )
    assert metrics["val/kl_forward"] > 0 and metrics["val/kl_reverse"] > 0
    vocab = len(built.tokenizer)
    wide = [(role, shape) for role, _, shapes in received for shape in shapes if any(d >= vocab for d in shape)]
    assert not wide, f"tensors of a vocabulary's width reached the controller: {wide}"
    trainer_bytes = sum(size for role, size, _ in received if role == "trainer")
    print(
        f"validation, 2 batches of 2: {trainer_bytes} bytes from the trainer ranks, "
        f"{sum(size for role, size, _ in received)} in all"
    )
    assert trainer_bytes < 10_000  # a few dicts of three floats, not [B, L, V]
