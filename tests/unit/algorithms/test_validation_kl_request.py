"""Which signal validation's KL asks a teacher for (:func:`opd.run.validation.kl_request`).

Validation asks only for what the teacher answers as configured, the teacher saying so
itself (``refusal``): the full vocabulary where it can, else the loss's own top-k, else
``validation.teacher_topk``, else no KL. A served teacher without its output layer must
never be asked for its full vocabulary (that stopped every served top-k run at its first
validation).
"""

from __future__ import annotations

import pytest

from opd.models.interfaces import FullVocabRequest, TeacherInterface, TokenLogprobsRequest, TopKRequest
from opd.run.validation import kl_request
from opd.teachers.served.remote_teacher import RemoteTeacher

VOCAB = 50


class Refusing(TeacherInterface):
    """A teacher that refuses the full vocabulary and any top-k with more than ``max_k`` ids."""

    def __init__(self, full_vocabulary: bool, max_k: int | None) -> None:
        self.full_vocabulary, self.max_k = full_vocabulary, max_k

    @classmethod
    def unsupported_reason(cls, request):
        return None

    def refusal(self, request):
        if isinstance(request, FullVocabRequest) and not self.full_vocabulary:
            return "no full vocabulary"
        if isinstance(request, TopKRequest) and (self.max_k is None or request.k > self.max_k):
            return "top-k too large"
        return None

    def score(self, data, request):
        raise AssertionError("kl_request never scores")


@pytest.mark.parametrize(
    ("full_vocabulary", "max_k", "loss_request", "expected"),
    [
        (True, 64, TopKRequest(8, 2.0, VOCAB), FullVocabRequest()),
        (False, 64, TopKRequest(8, 2.0, VOCAB), TopKRequest(8, 1.0, VOCAB)),  # the loss's k, at temperature 1
        (False, 16, FullVocabRequest(), TopKRequest(16, 1.0, VOCAB)),  # validation.teacher_topk
        (False, 16, TokenLogprobsRequest(VOCAB), TopKRequest(16, 1.0, VOCAB)),
        (False, 4, TopKRequest(8, 1.0, VOCAB), None),  # nothing it answers: no KL
        (False, None, None, None),
    ],
)
def test_the_most_exact_signal_the_teacher_answers_is_asked_for(full_vocabulary, max_k, loss_request, expected):
    teacher = Refusing(full_vocabulary, max_k)
    assert kl_request(teacher, loss_request, VOCAB, teacher_topk=16) == expected


def test_a_served_teacher_without_its_output_layer_refuses_the_full_vocabulary():
    # The class accepts full-vocabulary requests (a config may load the layer); the client as
    # configured, with no output layer checked against the server's, does not.
    assert RemoteTeacher.unsupported_reason(FullVocabRequest()) is None
    client = RemoteTeacher("http://127.0.0.1:9")  # never connected: nothing is sent
    assert "output layer" in str(client.refusal(FullVocabRequest()))
    assert client.refusal(TopKRequest(8, 1.0, VOCAB)) is None
    assert kl_request(client, TopKRequest(8, 1.0, VOCAB), VOCAB, teacher_topk=64) == TopKRequest(8, 1.0, VOCAB)
    client.close()
