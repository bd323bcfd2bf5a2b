"""``cluster.trainer.activation_checkpointing`` changes memory, not results: 2 FSDP2 ranks over gloo.

One training step of the real trainer (:class:`~opd.distributed.trainer_worker.TrainerWorker`:
the tiny student sharded over two ranks, the tiny teacher colocated and sharded, the exact
fused full-vocabulary loss, two micro-batches per rank) with and without activation
checkpointing gives the same loss and the same updated weights, while each student layer
runs its forward twice per micro-batch with it (once more in the backward) and once without.

The ranks are real processes in a real gloo process group, spawned with
``torch.multiprocessing``; no Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from opd_test_helpers import REPO_ROOT

from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
from opd.models.interfaces import AnsweredWhereTrained
from opd.models.tiny import build_tiny_tokenizer
from opd.utils.config import load_config

WORLD = 2
MICRO_BATCHES = 2
ROWS, PROMPT, LENGTH = 2, 5, 12


def _micro_batch(rank: int, index: int, vocab: int) -> BatchedDataDict:
    generator = torch.Generator().manual_seed(100 * rank + index)
    token_mask = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    token_mask[:, PROMPT:] = 1
    return BatchedDataDict(
        {
            "input_ids": torch.randint(0, vocab, (ROWS, LENGTH), generator=generator),
            "input_lengths": torch.full((ROWS,), LENGTH),
            "prompt_lengths": torch.full((ROWS,), PROMPT),
            "token_mask": token_mask,
        }
    )


def _counted(forward, calls: list[int]):
    """``forward``, counting its calls (a module hook would not see the backward's recomputation)."""

    def counting(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    return counting


def _train_once(rank: int, port: int, result_dir: str) -> None:
    config = load_config(
        MasterConfig,
        REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml",
        ["loss_fn.compile_kernels=false", "training.learning_rate=1e-2", "training.warmup_steps=0"],
    )
    vocab = len(build_tiny_tokenizer())
    loss_fn = config.loss_fn.build(vocab, "cpu")
    results = {}
    for checkpointing in (False, True):
        spec = TrainerSpec(
            student_path="tiny:student",
            teacher_path="tiny:teacher",
            loading=config.model,
            optimizer=config.training,
            total_steps=1,
            backend="gloo",
            timeout_s=120,
            threads=1,
            activation_checkpointing=checkpointing,
        )
        worker = TrainerWorker(rank, WORLD, spec)
        if checkpointing:  # the process group of the first run serves the second
            from torch.distributed.device_mesh import init_device_mesh

            worker.build(init_device_mesh("cpu", (WORLD,)), torch.device("cpu"))
        else:
            worker.start("127.0.0.1", port)
        calls = [0]
        for layer in worker.model.get_decoder().layers:
            layer.mlp.forward = _counted(layer.mlp.forward, calls)
        micro_batches = [_micro_batch(rank, index, vocab) for index in range(MICRO_BATCHES)]
        tokens = WORLD * MICRO_BATCHES * ROWS * (LENGTH - PROMPT)
        # The driver's colocated teacher answers that each rank scores its micro-batches in place.
        answers = [AnsweredWhereTrained(loss_fn.teacher_request)] * MICRO_BATCHES
        metrics = worker.train(loss_fn, tokens, WORLD * MICRO_BATCHES * ROWS, micro_batches, answers)
        weights = worker.whole_weights()
        results[checkpointing] = {
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "mlp_calls": calls[0],
            "layers": len(worker.model.get_decoder().layers),
            "weights": weights,
        }
    torch.save(results, Path(result_dir) / f"rank{rank}.pt")
    worker.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from opd.distributed.workers.ray_cluster import free_port

    directory = tmp_path_factory.mktemp("activation_checkpointing")
    mp.spawn(_train_once, args=(free_port(), str(directory)), nprocs=WORLD, join=True)
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_checkpointing_recomputes_each_layer_in_the_backward(runs):
    for rank_runs in runs:
        layers = rank_runs[False]["layers"]
        assert rank_runs[False]["mlp_calls"] == layers * MICRO_BATCHES
        assert rank_runs[True]["mlp_calls"] == 2 * layers * MICRO_BATCHES


def test_checkpointing_gives_the_same_loss_and_updated_weights(runs):
    for rank_runs in runs:
        plain, checkpointed = rank_runs[False], rank_runs[True]
        assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    plain_weights, checkpointed_weights = runs[0][False]["weights"], runs[0][True]["weights"]
    assert plain_weights.keys() == checkpointed_weights.keys() and plain_weights
    for name, tensor in plain_weights.items():
        torch.testing.assert_close(checkpointed_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
