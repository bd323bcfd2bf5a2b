"""The dry run (``opd plan``) catches a host tensor handed to a collective, and passes opd's own trainer.

On a GPU cluster the trainer's process group is NCCL, which has no CPU backend: a metric
all-reduced as a host tensor fails the first step (the defect fixed in c206a4c). The dry
run's device audit must catch exactly that on this CPU-only machine: with the defect put
back, it fails naming the collective, the host device and the line of opd that called it;
as the code is, the same step passes its collectives through the audit.

Each dry run is a process of its own (it registers a stand-in accelerator for its process).
"""

from __future__ import annotations

from pathlib import Path

from opd_test_helpers import REPO_ROOT, json_from_a_process_of_its_own

SCRIPT = Path(__file__).with_name("dry_run_script.py")
TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"


def dry_run(mode: str) -> dict:
    return json_from_a_process_of_its_own([str(SCRIPT), mode, str(TINY)], timeout_s=300)


def test_the_device_audit_catches_a_host_tensor_in_a_collective():
    result = dry_run("planted")
    assert "error" in result, result
    message = result["error"]
    assert "c10d.allreduce_" in message and "on 'cpu'" in message, message
    # The planted function, and the line of opd's trainer that called it.
    assert "_sum_over_ranks_on_the_host" in message and "opd/distributed/trainer_worker.py" in message, message
    assert "NCCL process group has no CPU backend" in message


def test_opds_trainer_passes_the_device_audit():
    result = dry_run("clean")
    assert "error" not in result, result
    assert result["collectives"] > 0  # FSDP2's all-gathers and reduce-scatters, the metrics' all-reduce
    assert result["peak"] >= result["student_parameters"] + result["optimizer_state"] + result["teacher_parameters"]


def test_tracing_the_first_two_loss_chunks_and_the_last_gives_the_memory_of_every_chunk():
    # 2 rows of 200 response positions in chunks of 64: 7 chunks, 6 of one shape and a last of 16 positions. At
    # this size the loss's chunks hold the rank's peak, so a trace that left out a chunk that matters misses it.
    result = dry_run("chunks")
    assert result["alike_once"]["chunks_per_call"] == [3]
    assert result["every_chunk"]["chunks_per_call"] == [7]
    assert result["alike_once"]["memory"] == result["every_chunk"]["memory"]
    assert result["every_chunk"]["memory"]["peak"] > 0
