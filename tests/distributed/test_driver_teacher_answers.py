"""The teacher the driver holds is the one that answers, in every placement.

For each placement (in process, served on 127.0.0.1, colocated in two FSDP2 trainer
workers of a real local Ray cluster, and a teacher pool of its own; a pool of vLLM engines in
``tests/with_vllm/test_vllm_teacher_pool.py``) a two-step run is
built with :func:`~opd.distillation.setup.setup`, and the driver's teacher
(``teacher_policy``) is wrapped to count the micro-batches it is asked about. The count
during each step's training must equal the micro-batches the trainer ran: a placement whose workers scored with a
teacher of their own, bypassing the driver's object, would count 0.

The run also prints the teacher plan that says where the teacher runs.
"""

from __future__ import annotations

import logging

import pytest
from opd_test_helpers import REPO_ROOT, RunningServer

from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.distillation.teacher_plan import Placement, plan_teacher
from opd.models.interfaces import PolicyInterface, TeacherInterface
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.policy.hf_policy import plan_micro_batches
from opd.teachers.scoring import PromptScorer
from opd.teachers.served.server import TeacherService
from opd.utils.config import load_config

TINY = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
STEPS = 2
CLUSTER = ["cluster.trainer.workers=2", "cluster.rollout.workers=1"]


@pytest.fixture(scope="module")
def served_url():
    """``opd serve-teacher``'s app serving the tiny teacher on a free port of 127.0.0.1."""
    tokenizer = build_tiny_tokenizer()
    service = TeacherService(
        PromptScorer(build_tiny_model("teacher").eval(), len(tokenizer)), tokenizer, "tiny-teacher", 128, 512
    )
    running = RunningServer(service)
    yield f"http://127.0.0.1:{running.port}"
    running.stop()


def micro_batches_trained(policy: PolicyInterface, batch) -> int:
    """How many micro-batches the trainer runs for ``batch`` (every rank's, on a cluster)."""
    if hasattr(policy, "plan"):  # the FSDP2 trainer: each rank's share, padded to the same count
        return sum(len(plan) for plan in policy.plan(batch))
    return len(plan_micro_batches(batch, policy.micro_batch_size, policy.micro_batch_tokens))


class CountingTeacher:
    """Counts what the driver asks ``teacher`` (``score_async``, one call per micro-batch), and delegates."""

    def __init__(self, teacher: TeacherInterface) -> None:
        self.asked = 0
        score_async = teacher.score_async

        def counted(data, request):
            self.asked += 1
            return score_async(data, request)

        teacher.score_async = counted  # type: ignore[method-assign]


PLACEMENTS = {
    "in_process": ([], Placement.IN_PROCESS),
    "served": (["teacher.backend=remote"], Placement.SERVED),
    "trainer_workers": ([*CLUSTER, "cluster.teacher.placement=colocated"], Placement.TRAINER_WORKERS),
    "pool": ([*CLUSTER, "cluster.teacher.placement=pool"], Placement.POOL),
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_drivers_teacher_answers_every_micro_batch(placement, tmp_path, request, caplog):
    overrides, expected_placement = PLACEMENTS[placement]
    if expected_placement is Placement.SERVED:
        overrides = [*overrides, f"teacher.remote.url={request.getfixturevalue('served_url')}"]
    if expected_placement in (Placement.TRAINER_WORKERS, Placement.POOL):
        request.getfixturevalue("ray_cluster")
    config = load_config(
        MasterConfig,
        TINY,
        [
            *overrides,
            f"output_dir={tmp_path}",
            f"training.max_num_steps={STEPS}",
            "training.val_freq=0",
            "checkpointing.enabled=false",
            "training.micro_batch_size=4",
        ],
    )
    assert [member.placement for member in plan_teacher(config).members] == [expected_placement]
    with caplog.at_level(logging.INFO, logger="opd"):
        components = setup(config)
    assert "teacher plan:" in caplog.text and f"runs {expected_placement.value}" in caplog.text
    try:
        trained, answered = count_teacher_answers(components)
    finally:
        components.close()
    assert len(trained) == STEPS
    assert answered == trained and min(trained) > 0


def count_teacher_answers(components) -> tuple[list[int], list[int]]:
    """Trains the components' run; per step, the micro-batches trained and the driver's teacher's answers during it."""
    counter = CountingTeacher(components.teacher_policy)
    trained, answered = [], []
    train = components.student_policy.train

    def recorded(batch, *args, **kwargs):  # the micro-batches of each step, and the answers during it
        trained.append(micro_batches_trained(components.student_policy, batch))
        before = counter.asked
        metrics = train(batch, *args, **kwargs)
        answered.append(counter.asked - before)
        return metrics

    components.student_policy.train = recorded  # type: ignore[method-assign]
    distillation_train(components)
    return trained, answered
