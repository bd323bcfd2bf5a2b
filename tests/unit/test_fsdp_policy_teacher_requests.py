"""The distributed trainer's controller asks the teacher for every micro-batch at once, and sends each its own answer.

:meth:`opd.distributed.fsdp_policy.FSDPPolicy.train` plans each rank's micro-batches and,
when the teacher runs apart from the trainer (a teacher pool, a served teacher), gets
their signals before it calls the ranks. Given a
:class:`~opd.models.interfaces.MicroBatchScorer` (what the driver hands it), it starts
every micro-batch's request before it collects any answer, so a pool's replicas have
them all queued at once; a plain function is still called micro-batch by micro-batch.
Either way each rank gets, for each of its micro-batches, that micro-batch's own answer,
in order:

* a served teacher (``opd serve-teacher``'s app on 127.0.0.1, :class:`RemoteTeacher`,
  whose ``score_async`` runs on a thread of its own);
* routed teachers (:class:`RoutedTeachers`, which answers ``score_async`` with a
  :class:`~opd.models.interfaces.Done`);
* a plain function.

The ranks are stood in for by a recorder of what they would be sent (no Ray).
"""

from __future__ import annotations

import pytest
import torch
from opd_test_helpers import RunningServer

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.fsdp_policy import FSDPPolicy
from opd.losses.nll import NLLLossFn
from opd.models.interfaces import (
    MicroBatchScorer,
    Pending,
    PerTeacherRequest,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKRequest,
)
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.scoring import PromptScorer
from opd.teachers.served.remote_teacher import RemoteTeacher
from opd.teachers.served.server import TeacherService
from opd.teachers.several_teachers import RoutedTeachers

RANKS = 2
MICRO_BATCH_SIZE = 2


class RecordingRanks:
    """Stands in for the trainer's worker group: records what each rank would be sent."""

    size = RANKS

    def __init__(self) -> None:
        self.sent: list[tuple[list[BatchedDataDict], list[TeacherSignal]]] = []

    def call(self, method: str, *args, shares):
        assert method == "train"
        self.sent = list(shares)
        return [{"loss": 0.0, "teacher_seconds": 0.0, "compute_seconds": 0.0}] * RANKS


def batch() -> BatchedDataDict:
    """9 rows of different lengths: 5 and 4 rows per rank, 3 and 2 micro-batches (one of them idle)."""
    generator = torch.Generator().manual_seed(11)
    lengths = torch.tensor([10, 4, 7, 12, 5, 9, 3, 8, 6])
    ids = torch.randint(3, 250, (9, 12), generator=generator)
    mask = torch.arange(12)[None, :] < lengths[:, None]
    token_mask = mask & (torch.arange(12)[None, :] >= 2)
    return BatchedDataDict({
        "input_ids": ids * mask, "input_lengths": lengths, "token_mask": token_mask.long(),
        "teacher_index": torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1]),
    })


class OrderLog:
    """Wraps a submit function, logging when each micro-batch is started and when it is collected."""

    def __init__(self, submit) -> None:
        self.submit, self.events = submit, []

    def __call__(self, micro_batch: BatchedDataDict) -> Pending[TeacherSignal]:
        number = sum(event == "start" for event, _ in self.events)
        self.events.append(("start", number))
        pending, log = self.submit(micro_batch), self.events

        class Logged(Pending[TeacherSignal]):
            def result(self) -> TeacherSignal:
                log.append(("collect", number))
                return pending.result()

        return Logged()


def sent_and_expected(teacher: TeacherInterface, request: TeacherRequest, scorer) -> tuple[list, list]:
    ranks = RecordingRanks()
    FSDPPolicy(ranks, MICRO_BATCH_SIZE, None, False).train(batch(), NLLLossFn(), scorer)  # type: ignore[arg-type]
    sent = [signal for _, signals in ranks.sent for signal in signals]
    expected = [teacher.score(micro_batch, request) for micro_batches, _ in ranks.sent for micro_batch in micro_batches]
    return sent, expected


def assert_equal_signals(actual, expected) -> None:
    assert type(actual) is type(expected)
    if isinstance(actual, torch.Tensor):
        assert torch.equal(actual, expected)
    elif isinstance(actual, tuple):
        assert all(torch.equal(mine, reference) for mine, reference in zip(actual, expected, strict=True))
    else:  # several teachers: their combined answer
        assert_equal_signals(actual.combined(), expected.combined())


@pytest.fixture(scope="module")
def teacher_model():
    return build_tiny_model("teacher").eval()


@pytest.fixture(scope="module")
def served(teacher_model):
    tokenizer = build_tiny_tokenizer()
    running = RunningServer(
        TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny-teacher", 128, 512)
    )
    remote = RemoteTeacher(running.url, max_concurrency=2, sequences_per_request=2, timeout_s=30.0, max_retries=3,
                           backoff_s=0.01)
    remote.connect(tokenizer)
    yield remote
    remote.close()
    running.stop()


def test_a_served_teacher_is_asked_for_every_micro_batch_before_any_answer_is_collected(served):
    request = TopKRequest(k=4)
    log = OrderLog(lambda micro_batch: served.score_async(micro_batch, request))
    sent, expected = sent_and_expected(served, request, MicroBatchScorer(log))
    assert len(sent) == 6  # 3 micro-batches on each rank
    for actual, reference in zip(sent, expected, strict=True):
        assert_equal_signals(actual, reference)
    starts = [index for index, (event, _) in enumerate(log.events) if event == "start"]
    collects = [index for index, (event, _) in enumerate(log.events) if event == "collect"]
    assert len(starts) == len(collects) == 6
    assert max(starts) < min(collects)  # every request started before the first answer was collected
    assert [number for event, number in log.events if event == "collect"] == list(range(6))


def test_routed_teachers_give_each_micro_batch_its_own_answer(teacher_model):
    members = [LocalTeacher(teacher_model), LocalTeacher(build_tiny_model("student-b").eval())]
    routed = RoutedTeachers(["a", "b"], members)
    request = PerTeacherRequest((TopKRequest(k=3), TokenLogprobsRequest()))
    sent, expected = sent_and_expected(routed, request, MicroBatchScorer(lambda mb: routed.score_async(mb, request)))
    for actual, reference in zip(sent, expected, strict=True):
        assert [part.teacher for part in actual.parts] == [part.teacher for part in reference.parts]
        for mine, theirs in zip(actual.parts, reference.parts, strict=True):
            assert torch.equal(mine.rows, theirs.rows)
            assert_equal_signals(mine.signal, theirs.signal)


def test_a_plain_function_is_called_micro_batch_by_micro_batch(teacher_model):
    teacher, request = LocalTeacher(teacher_model), TokenLogprobsRequest()
    calls: list[int] = []

    def score(micro_batch: BatchedDataDict) -> TeacherSignal:
        calls.append(micro_batch.size)
        return teacher.score(micro_batch, request)

    sent, expected = sent_and_expected(teacher, request, score)
    assert len(calls) == len(sent) == 6
    for actual, reference in zip(sent, expected, strict=True):
        assert_equal_signals(actual, reference)
