"""What a trainer worker does with several teachers' answers and forwards, without Ray (fast).

* :func:`bind_members`: a routed answer's parts are each bound to their own member's
  output layer; a mixture whose members sent hidden states alone is mixed once each is
  bound, exactly as :func:`mix_logits` mixes in one process; a member without a layer is
  named in the error.
* :class:`Lockstep`: each colocated sharded teacher runs one forward per micro-batch, in
  member order, whichever members the routing asked (the others run a stand-in forward).
"""

from __future__ import annotations

import pytest
import torch

from opd.distributed.trainer_worker import InTurn, Lockstep, bind_members
from opd.models.interfaces import TeacherHiddenStates, TokenLogprobsRequest
from opd.models.lm_head import LMHeadInput, OutputLayer
from opd.teachers.several_teachers import MixedSignal, RoutedPart, RoutedSignal, mix_logits

VOCAB, WIDTH = 11, 4


def heads() -> list[OutputLayer]:
    generator = torch.Generator().manual_seed(0)
    return [OutputLayer(torch.randn(VOCAB, WIDTH, generator=generator)) for _ in range(2)]


def hidden(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 3, WIDTH, generator=torch.Generator().manual_seed(seed))


def test_each_routed_part_is_bound_to_its_own_members_head():
    layers = heads()
    parts = [
        RoutedPart(0, torch.tensor([1]), TeacherHiddenStates(hidden(1, 1))),
        RoutedPart(1, torch.tensor([0, 2]), TeacherHiddenStates(hidden(2, 2))),
    ]
    bound = bind_members(RoutedSignal(parts, 3, {"a": 1.0}), layers, "rank 0")
    assert isinstance(bound, RoutedSignal) and bound.seconds == {"a": 1.0}
    for part, layer in zip(bound.parts, layers, strict=True):
        assert isinstance(part.signal, LMHeadInput)
        assert torch.equal(part.signal.weight, layer.weight)
    combined = bound.combined()
    assert torch.allclose(combined[1], hidden(1, 1)[0] @ layers[0].weight.T)
    assert torch.allclose(combined[2], hidden(2, 2)[1] @ layers[1].weight.T)


def test_a_mixture_of_hidden_states_is_mixed_once_bound_as_in_one_process():
    layers = heads()
    weights = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    members = [TeacherHiddenStates(hidden(2, 3)), TeacherHiddenStates(hidden(2, 4))]
    waiting = MixedSignal(None, list(members), weights, temperature=2.0)
    with pytest.raises(ValueError, match="bind them to their output layers first"):
        waiting.combined()
    mixed = bind_members(waiting, layers, "rank 0")
    logits = [member.hidden_states @ layer.weight.T for member, layer in zip(members, layers, strict=True)]
    assert isinstance(mixed, MixedSignal)
    assert torch.allclose(mixed.combined(), mix_logits(logits, weights, 2.0), rtol=1e-6, atol=1e-6)
    assert torch.allclose(mixed.members[1], logits[1])


def test_a_member_without_its_head_is_named():
    parts = [RoutedPart(1, torch.tensor([0]), TeacherHiddenStates(hidden(1, 5)))]
    with pytest.raises(ValueError, match="trainer rank 3 holds no copy of the teacher's output layer"):
        bind_members(RoutedSignal(parts, 1), heads()[:1], "trainer rank 3")


class Recorder:
    """A colocated teacher that records its forwards (``log``: (member, stand-in or scored))."""

    def __init__(self, position: int, log: list[tuple[int, str]]) -> None:
        self.position, self.log = position, log

    def final_hidden_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.log.append((self.position, "stand-in"))
        return torch.zeros(1, 1, WIDTH)

    def score(self, data, request):
        self.log.append((self.position, "scored"))
        return torch.zeros(1)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ([1], [(0, "stand-in"), (1, "scored"), (2, "stand-in")]),
        ([0, 2], [(0, "scored"), (1, "stand-in"), (2, "scored")]),
        ([], [(0, "stand-in"), (1, "stand-in"), (2, "stand-in")]),
    ],
)
def test_every_sharded_member_runs_one_forward_per_micro_batch_in_member_order(asked, expected):
    log: list[tuple[int, str]] = []
    members = [Recorder(position, log) for position in range(3)]
    lockstep = Lockstep(members, torch.device("cpu"))  # type: ignore[arg-type]
    in_turn = [InTurn(member, position, lockstep) for position, member in enumerate(members)]  # type: ignore[arg-type]
    for micro_batch in range(2):  # the turns start again with each micro-batch
        for position in asked:
            in_turn[position].score(None, TokenLogprobsRequest())  # type: ignore[arg-type]
        lockstep.finish()
        assert log == expected, micro_batch
        log.clear()
