"""Several teachers: routing, mixtures, per-teacher metrics, data and config errors, a real run.

* routing: each row is scored by its own teacher only (teachers without rows are not
  called); the routed loss and its gradient equal a float64 reference that takes each
  row's teacher (full vocabulary, fused and not, top-k, JSD, sampled token); each
  teacher's KL is the mean over its own tokens;
* mixtures: the mixed logits, token log-probs and top-k against float64 references; a
  mixture with one weight at 1 equals that teacher alone (loss and gradient); the mixture
  loss against a float64 KL to ``Σ_i w_i p_i`` with per-example weights;
* data and config mistakes name the file, line or key;
* ``opd train`` with two tiny teachers routed by a ``task`` field: every example reaches
  its teacher (additions one, subtractions the other), and the per-teacher metrics are
  logged.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from opd_test_helpers import REPO_ROOT

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.dataloaders import prepare_examples
from opd.data.teacher_choice import TeacherChoice
from opd.distillation.config import MasterConfig
from opd.distillation.setup import setup
from opd.distillation.step import distillation_train
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.sampled_token import SampledTokenLossFn
from opd.losses.several_teachers_loss import MixtureLoss, RoutedLoss
from opd.models.interfaces import (
    FullVocabRequest,
    PerTeacherRequest,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import LMHeadInput
from opd.models.step_metrics import accumulate_metrics
from opd.models.tiny import build_tiny_tokenizer
from opd.teachers.several_teachers import (
    MixedSignal,
    RoutedTeachers,
    TeacherMixture,
    mix_logits,
    mix_token_logprobs,
    mix_topk,
)
from opd.utils.config import load_config
from opd.utils.errors import ConfigError, DataError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
B, L, V, D = 6, 9, 13, 5


class TableTeacher(TeacherInterface):
    """A teacher whose logits for each row are fixed in a table (indexed by the batch's ``row_id``).

    Records the rows it was asked to score; answers every request from its table exactly
    as a real teacher would (top-k with the rest mass, token log-probs at the token's
    position, hidden states with a head when the loss prefers them).
    """

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn(B, L, D, generator=g)
        self.head = torch.randn(V, D, generator=g) * 1.5
        self.calls: list[list[int]] = []

    @property
    def logits(self) -> torch.Tensor:
        return self.hidden @ self.head.T

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        return None

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        rows = data["row_id"]
        self.calls.append(rows.tolist())
        if isinstance(request, FullVocabRequest):
            if request.prefer_hidden_states:
                return LMHeadInput(self.hidden[rows].clone(), self.head)
            return self.logits[rows].clone()
        log_probs = torch.log_softmax(self.logits[rows].double(), dim=-1)
        if isinstance(request, TopKRequest):
            log_probs = torch.log_softmax(self.logits[rows].double() / request.temperature, dim=-1)
            k = min(request.k, V)
            values, ids = log_probs.topk(k, dim=-1)
            outside = log_probs.scatter(-1, ids, -math.inf)
            return TopKLogprobs(values.float(), ids, torch.logsumexp(outside, dim=-1).float())
        assert isinstance(request, TokenLogprobsRequest)
        out = torch.zeros(len(rows), L)
        out[:, 1:] = log_probs[:, :-1].gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1).float()
        return out


def make_batch(seed: int = 0, response_lengths=(4, 0, 6, 3, 7, 5)) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(B, L, dtype=torch.long)
    for row, length in enumerate(response_lengths):
        token_mask[row, 2 : 2 + length] = 1
    return BatchedDataDict(
        row_id=torch.arange(B),
        input_ids=torch.randint(0, V, (B, L), generator=g),
        token_mask=token_mask,
        generation_logprobs=-torch.rand(B, L, generator=g),
    )


def student_output(seed: int = 7, fused: bool = False) -> tuple[torch.Tensor | LMHeadInput, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, D, generator=g).requires_grad_()
    head = (torch.randn(V, D, generator=g) * 0.7).requires_grad_()
    if fused:
        return LMHeadInput(hidden, head), [hidden, head]
    return hidden @ head.T, [hidden, head]


def counts(data) -> tuple[int, int]:
    return int(data["token_mask"][:, 1:].sum()), B


def f64_forward_kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over loss positions of KL(p‖q) in float64 (positions t predict token t + 1)."""
    log_p = torch.log_softmax(teacher_logits.double(), -1)[:, :-1]
    log_q = torch.log_softmax(student_logits.double(), -1)[:, :-1]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (kl * mask[:, 1:].double()).sum()


# ------------------------------------------------------------------ routing


def test_each_row_is_scored_by_its_own_teacher_and_unused_teachers_are_not_called():
    teachers = [TableTeacher(1), TableTeacher(2), TableTeacher(3)]
    data = make_batch()
    data["teacher_index"] = torch.tensor([1, 0, 1, 1, 0, 0])
    answer = RoutedTeachers(["a", "b", "c"], teachers).score(data, FullVocabRequest())
    assert teachers[0].calls == [[1, 4, 5]] and teachers[1].calls == [[0, 2, 3]] and teachers[2].calls == []
    combined = answer.combined()
    expected = torch.stack([teachers[int(i)].logits[row] for row, i in enumerate(data["teacher_index"])])
    assert torch.equal(combined, expected)
    assert sorted(answer.seconds) == ["a", "b"]


def test_routing_refuses_rows_without_a_teacher_index():
    with pytest.raises(ValueError, match="teacher_index"):
        RoutedTeachers(["a"], [TableTeacher(1)]).score(make_batch(), FullVocabRequest())
    data = make_batch()
    data["teacher_index"] = torch.tensor([0, 0, 0, 0, 0, 2])
    with pytest.raises(ValueError, match="outside 0..1"):
        RoutedTeachers(["a", "b"], [TableTeacher(1), TableTeacher(2)]).score(data, FullVocabRequest())


OBJECTIVES = {
    "forward": lambda fused: KLLossFn(kl_type="forward", fused_lm_head=fused),
    "reverse": lambda fused: KLLossFn(kl_type="reverse", fused_lm_head=fused),
    "jsd": lambda fused: JSDLossFn(beta=0.3, fused_lm_head=fused),
    "topk": lambda fused: TopKKLLossFn(kl_type="forward", k=4),
    "sampled_token": lambda fused: SampledTokenLossFn(clip_ratio=None),
}


def _per_row_teacher_signal(objective, teachers, index, data):
    """The reference: every row answered by its own teacher, assembled into one plain answer."""
    request = objective.teacher_request
    if isinstance(request, FullVocabRequest):
        request = FullVocabRequest(prefer_hidden_states=False)
    answers = [teacher.score(data, request) for teacher in teachers]
    for teacher in teachers:
        teacher.calls.clear()
    pick = lambda parts: torch.stack([parts[int(i)][row] for row, i in enumerate(index)])  # noqa: E731
    if isinstance(request, TopKRequest):
        return TopKLogprobs(pick([a[0] for a in answers]), pick([a[1] for a in answers]),
                            pick([a.rest_logprobs for a in answers]))
    return pick(answers)


# The fused head is exercised with the full-vocabulary signals, the ones that send hidden states.
ROUTED_CASES = [(name, False) for name in sorted(OBJECTIVES)] + [(name, True) for name in ("forward", "jsd", "reverse")]


@pytest.mark.parametrize(("name", "fused"), ROUTED_CASES)
def test_the_routed_loss_equals_the_loss_with_each_rows_own_teacher(name, fused):
    teachers = [TableTeacher(1), TableTeacher(2)]
    data = make_batch()
    data["teacher_index"] = torch.tensor([1, 0, 0, 1, 1, 0])
    objective = OBJECTIVES[name](fused)
    routed = RoutedLoss([objective, objective], ["a", "b"])
    answer = RoutedTeachers(["a", "b"], teachers).score(data, routed.teacher_request)
    student, params = student_output(fused=fused)
    loss, metrics = routed(student, data, *counts(data), teacher_output=answer)
    grads = torch.autograd.grad(loss, params)

    reference_student, reference_params = student_output(fused=False)
    reference_objective = OBJECTIVES[name](False)
    signal = _per_row_teacher_signal(reference_objective, teachers, data["teacher_index"], data)
    expected, _ = reference_objective(reference_student, data, *counts(data), teacher_output=signal)
    expected_grads = torch.autograd.grad(expected, reference_params)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert metrics["teacher/a/num_valid_tokens"] + metrics["teacher/b/num_valid_tokens"] == metrics["num_valid_tokens"]


def test_the_routed_forward_kl_equals_a_float64_sum_over_each_rows_teacher():
    teachers = [TableTeacher(1), TableTeacher(2)]
    data = make_batch()
    index = torch.tensor([0, 1, 1, 0, 1, 0])
    data["teacher_index"] = index
    objective = KLLossFn(kl_type="forward", fused_lm_head=True)
    routed = RoutedLoss([objective, objective], ["a", "b"])
    student, (hidden, head) = student_output(fused=True)
    answer = RoutedTeachers(["a", "b"], teachers).score(data, routed.teacher_request)
    loss, _ = routed(student, data, *counts(data), teacher_output=answer)
    teacher_logits = torch.stack([teachers[int(i)].logits[row] for row, i in enumerate(index)])
    expected = f64_forward_kl_sum(teacher_logits, hidden.detach() @ head.detach().T, data["token_mask"])
    assert abs(float(loss) - float(expected) / counts(data)[0]) < 1e-6


def test_each_teachers_kl_is_the_mean_over_its_own_tokens_across_micro_batches():
    teachers = [TableTeacher(1), TableTeacher(2)]
    data = make_batch()
    index = torch.tensor([0, 1, 1, 0, 1, 0])
    data["teacher_index"] = index
    objective = KLLossFn(kl_type="forward")
    routed = RoutedLoss([objective, objective], ["a", "b"])
    group = RoutedTeachers(["a", "b"], teachers)
    student, _ = student_output()
    totals: dict[str, float] = {}
    for micro in (data.slice(0, 4), data.slice(4, 6)):  # the trainer's micro-batches, one global normaliser
        _, metrics = routed(student[micro["row_id"]], micro, *counts(data), teacher_output=group.score(micro, routed.teacher_request))
        accumulate_metrics(totals, metrics)
    finished = routed.finish_metrics(totals)
    mask = data["token_mask"]
    for position, name in enumerate(["a", "b"]):
        rows = (index == position).nonzero().squeeze(-1)
        tokens = int(mask[rows, 1:].sum())
        expected = f64_forward_kl_sum(teachers[position].logits[rows], student[rows].detach(), mask[rows]) / tokens
        assert abs(finished[f"teacher/{name}/kl_forward"] - float(expected)) < 1e-5
        assert finished[f"teacher/{name}/token_share"] == pytest.approx(tokens / counts(data)[0])
    assert "teacher/a/num_valid_tokens" not in finished
    assert finished["teacher/a/token_share"] + finished["teacher/b/token_share"] == pytest.approx(1.0)


def f64_topk_forward_kl_sum(teacher_logits, student_logits, mask, k):
    """Σ over loss positions of the forward KL over the teacher's top k plus one rest class, in float64."""
    log_p = torch.log_softmax(teacher_logits.double(), -1)[:, :-1]
    log_q = torch.log_softmax(student_logits.double(), -1)[:, :-1]
    top_p, ids = log_p.topk(k, dim=-1)
    top_q = log_q.gather(-1, ids)
    rest_p = torch.log1p(-top_p.exp().sum(-1).clamp(max=1 - 1e-12))
    rest_q = torch.log1p(-top_q.exp().sum(-1).clamp(max=1 - 1e-12))
    kl = (top_p.exp() * (top_p - top_q)).sum(-1) + rest_p.exp() * (rest_p - rest_q)
    return (kl * mask[:, 1:].double()).sum()


def test_each_routed_teacher_answers_its_own_signal_and_is_distilled_with_its_own_objective():
    teachers = [TableTeacher(1), TableTeacher(2)]
    data = make_batch()
    index = torch.tensor([0, 1, 1, 0, 1, 0])
    data["teacher_index"] = index
    full = KLLossFn(kl_type="forward")
    topk = TopKKLLossFn(kl_type="forward", k=3)
    routed = RoutedLoss([full, topk], ["a", "b"])
    request = routed.teacher_request
    assert request == PerTeacherRequest((full.teacher_request, topk.teacher_request))
    answer = RoutedTeachers(["a", "b"], teachers).score(data, request)
    kinds = {part.teacher: type(part.signal) for part in answer.parts}
    assert kinds == {0: torch.Tensor, 1: TopKLogprobs}
    student, (hidden, head) = student_output()
    loss, metrics = routed(student, data, *counts(data), teacher_output=answer)
    mask = data["token_mask"]
    a, b = (index == 0).nonzero().squeeze(-1), (index == 1).nonzero().squeeze(-1)
    logits = hidden.detach() @ head.detach().T
    expected = (f64_forward_kl_sum(teachers[0].logits[a], logits[a], mask[a])
                + f64_topk_forward_kl_sum(teachers[1].logits[b], logits[b], mask[b], 3)) / counts(data)[0]
    assert abs(float(loss) - float(expected)) < 1e-6
    finished = routed.finish_metrics(metrics)
    tokens_b = int(mask[b, 1:].sum())
    expected_b = f64_topk_forward_kl_sum(teachers[1].logits[b], logits[b], mask[b], 3) / tokens_b
    assert finished["teacher/b/kl_forward"] == pytest.approx(float(expected_b), abs=1e-5)
    # With one objective for both, the teachers are asked one plain request.
    assert RoutedLoss([full, full], ["a", "b"]).teacher_request == full.teacher_request


def test_objectives_of_routed_teachers_must_agree_on_the_fused_head():
    with pytest.raises(ValueError, match="fused LM head"):
        RoutedLoss([KLLossFn(fused_lm_head=True), KLLossFn(fused_lm_head=False)], ["a", "b"])
    with pytest.raises(ValueError, match="one objective per teacher"):
        RoutedLoss([KLLossFn()], ["a", "b"])


def test_a_request_per_teacher_is_answered_only_by_routed_teachers():
    request = PerTeacherRequest((FullVocabRequest(), TopKRequest(2, 1.0, V)))
    data = make_batch()
    data["teacher_weights"] = random_weights(B, 2)
    mixture = TeacherMixture(["a", "b"], [TableTeacher(1), TableTeacher(2)])
    assert "cannot ask each for its own" in mixture.refusal(request)
    with pytest.raises(ValueError, match="cannot ask each for its own"):
        mixture.score(data, request)
    assert "one teacher answers one signal" in TableTeacher(1).refusal(request)
    with pytest.raises(ValueError, match="2 requests for 3 teachers"):
        data["teacher_index"] = torch.zeros(B, dtype=torch.long)
        RoutedTeachers(["a", "b", "c"], [TableTeacher(1), TableTeacher(2), TableTeacher(3)]).score(data, request)


# ------------------------------------------------------------------ mixtures


def random_weights(rows: int, members: int, seed: int = 3) -> torch.Tensor:
    weights = torch.rand(rows, members, generator=torch.Generator().manual_seed(seed)) + 0.05
    return weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_mixed_logits_soften_back_to_the_float64_mixture(temperature):
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(B, L, V, generator=g) * 4 for _ in range(3)]
    weights = random_weights(B, 3)
    mixed = mix_logits(logits, weights, temperature)
    expected = sum(w.double()[:, None, None] * torch.softmax(z.double() / temperature, -1)
                   for w, z in zip(weights.T, logits, strict=True))
    torch.testing.assert_close(torch.softmax(mixed.double() / temperature, -1), expected, rtol=1e-5, atol=1e-7)


def test_mixed_token_logprobs_are_the_log_of_the_float64_mixture():
    g = torch.Generator().manual_seed(1)
    logprobs = [torch.log_softmax(torch.randn(B, L, V, generator=g), -1)[..., 0] for _ in range(2)]
    for member in logprobs:
        member[:, 0] = 0.0  # position 0 has no token log-prob
    weights = random_weights(B, 2)
    mixed = mix_token_logprobs(logprobs, weights)
    expected = (weights[:, 0:1].double() * logprobs[0].double().exp() + weights[:, 1:2].double() * logprobs[1].double().exp()).log()
    torch.testing.assert_close(mixed.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.all(mixed[:, 0].abs() < 1e-6)


def _topk_answer(logits: torch.Tensor, k: int) -> TopKLogprobs:
    log_probs = torch.log_softmax(logits.double(), -1)
    values, ids = log_probs.topk(k, -1)
    return TopKLogprobs(values.float(), ids, torch.logsumexp(log_probs.scatter(-1, ids, -math.inf), -1).float())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mixed_topk_against_a_python_reference(k):
    g = torch.Generator().manual_seed(2)
    logits = [torch.randn(2, 3, V, generator=g) * 3 for _ in range(2)]
    weights = random_weights(2, 2)
    answers = [_topk_answer(z, k) for z in logits]
    mixed = mix_topk(answers, weights, k)
    for b in range(2):
        for t in range(3):
            candidates: dict[int, float] = {}
            rest = 0.0
            for member, answer in enumerate(answers):
                w = float(weights[b, member])
                for value, token in zip(answer[0][b, t].tolist(), answer[1][b, t].tolist(), strict=True):
                    candidates[token] = candidates.get(token, 0.0) + w * math.exp(value)
                rest += w * math.exp(float(answer.rest_logprobs[b, t]))
            chosen = sorted(candidates.items(), key=lambda item: -item[1])[:k]
            rest += sum(p for token, p in candidates.items() if token not in dict(chosen))
            assert mixed[1][b, t].tolist() == [token for token, _ in chosen]
            assert mixed[0][b, t].double().exp().tolist() == pytest.approx([p for _, p in chosen], rel=1e-6)
            assert math.exp(float(mixed.rest_logprobs[b, t])) == pytest.approx(rest, rel=1e-5)
            total = float(mixed[0][b, t].double().exp().sum()) + math.exp(float(mixed.rest_logprobs[b, t]))
            assert total == pytest.approx(1.0, abs=1e-6)


def test_mixed_topk_over_the_whole_vocabulary_is_the_exact_mixture():
    g = torch.Generator().manual_seed(4)
    logits = [torch.randn(B, L, V, generator=g) * 2 for _ in range(2)]
    weights = random_weights(B, 2)
    mixed = mix_topk([_topk_answer(z, V) for z in logits], weights, V)
    dense = torch.full((B, L, V), 0.0, dtype=torch.float64).scatter(-1, mixed[1], mixed[0].double().exp())
    expected = sum(w.double()[:, None, None] * torch.softmax(z.double(), -1) for w, z in zip(weights.T, logits, strict=True))
    torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-7)
    assert torch.all(torch.isneginf(mixed.rest_logprobs) | (mixed.rest_logprobs < -13))


@pytest.mark.parametrize("name", ["forward", "reverse", "jsd", "topk", "sampled_token"])
def test_a_mixture_with_one_weight_at_one_equals_that_teacher_alone(name):
    teachers = [TableTeacher(1), TableTeacher(2)]
    data = make_batch()
    data["teacher_weights"] = torch.tensor([[0.0, 1.0]] * B)
    objective = OBJECTIVES[name](False)
    mixture = MixtureLoss(objective, ["a", "b"])
    answer = TeacherMixture(["a", "b"], teachers).score(data, mixture.teacher_request)
    student, params = student_output()
    loss, metrics = mixture(student, data, *counts(data), teacher_output=answer)
    grads = torch.autograd.grad(loss, params)
    alone_student, alone_params = student_output()
    expected, _ = objective(alone_student, data, *counts(data), teacher_output=teachers[1].score(data, objective.teacher_request))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, alone_params), strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert metrics["teacher/b/token_share"] == pytest.approx(1.0) and metrics["teacher/a/token_share"] == 0.0


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_the_mixture_loss_is_the_float64_kl_to_the_weighted_mixture(temperature):
    teachers = [TableTeacher(1), TableTeacher(2), TableTeacher(5)]
    data = make_batch()
    weights = random_weights(B, 3)
    data["teacher_weights"] = weights
    mixture = MixtureLoss(KLLossFn(kl_type="forward", temperature=temperature, fused_lm_head=True), list("abc"))
    answer = TeacherMixture(list("abc"), teachers, temperature).score(data, mixture.teacher_request)
    assert isinstance(answer, MixedSignal)
    student, (hidden, head) = student_output(fused=True)
    loss, metrics = mixture(student, data, *counts(data), teacher_output=answer)
    p = sum(w.double()[:, None, None] * torch.softmax(t.logits.double() / temperature, -1)
            for w, t in zip(weights.T, teachers, strict=True))
    log_q = torch.log_softmax((hidden.detach() @ head.detach().T).double() / temperature, -1)
    kl = (p * (p.log() - log_q)).sum(-1)[:, :-1]
    expected = float((kl * data["token_mask"][:, 1:]).sum()) / counts(data)[0]
    assert abs(float(loss) - expected) < 1e-6
    # Each member's own KL (forward, at the loss temperature), as the loss on that member alone reports it.
    for name, teacher in zip("abc", teachers, strict=True):
        alone, _ = KLLossFn(kl_type="forward", temperature=temperature)(
            (hidden @ head.T).detach(), data, *counts(data), teacher_output=teacher.logits)
        assert metrics[f"teacher/{name}/kl_forward"] == pytest.approx(float(alone), rel=1e-5)


# ------------------------------------------------------------------ data and config mistakes


def _rows(*fields):
    return [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}], **extra}
            for i, extra in enumerate(fields)]


def test_routing_reads_each_examples_teacher_and_names_bad_rows():
    tokenizer = build_tiny_tokenizer()
    choice = TeacherChoice(("math", "code"), "route", route_key="task", route_map={"gsm8k": "math", "mbpp": "code"},
                           default="math")
    examples = prepare_examples(_rows({"task": "mbpp"}, {"task": "gsm8k"}, {}, {"task": "other"}), tokenizer, None,
                                "train.jsonl", teacher_choice=choice)
    assert [example["teacher_index"] for example in examples] == [1, 0, 0, 0]
    strict = TeacherChoice(("math", "code"), "route", route_key="task")
    with pytest.raises(DataError, match=r'train.jsonl: example 2: "task" = \'poetry\' names no teacher; '
                                        r"teachers.members are math, code"):
        prepare_examples(_rows({"task": "code"}, {"task": "poetry"}), tokenizer, None, "train.jsonl",
                         teacher_choice=strict)
    with pytest.raises(DataError, match=r'example 1: missing "task" \(teachers.route_key\)'):
        prepare_examples(_rows({}), tokenizer, None, "train.jsonl", teacher_choice=strict)


def test_mixture_weights_are_normalised_per_example_and_bad_ones_are_named():
    tokenizer = build_tiny_tokenizer()
    fixed = TeacherChoice(("a", "b"), "mixture", weights=(1.0, 3.0))
    assert prepare_examples(_rows({}), tokenizer, None, "t.jsonl", teacher_choice=fixed)[0]["teacher_weights"] == [0.25, 0.75]
    per_example = TeacherChoice(("a", "b"), "mixture", weights=(1.0, 1.0), weights_key="mix")
    examples = prepare_examples(_rows({"mix": {"b": 2}}, {"mix": {"a": 1, "b": 1}}), tokenizer, None, "t.jsonl",
                                teacher_choice=per_example)
    assert [example["teacher_weights"] for example in examples] == [[0.0, 1.0], [0.5, 0.5]]
    for bad, message in [({"mix": {"c": 1}}, r"names unknown teachers \['c'\]"),
                         ({"mix": {"a": -1, "b": 2}}, "weights must be >= 0 with a positive sum"),
                         ({"mix": {"a": True}}, '"mix".a must be a finite number'),
                         ({}, r'"mix" \(teachers.weights_key\) must be an object')]:
        with pytest.raises(DataError, match=r"t.jsonl: example 2: .*" + message):
            prepare_examples(_rows({"mix": {"a": 1}}, bad), tokenizer, None, "t.jsonl", teacher_choice=per_example)


TWO_TEACHERS = ["teachers.mode=route", "teachers.route_key=task", "model.teacher_model_path=null",
                "teachers.members=[{name: add, model_path: 'tiny:teacher'}, {name: sub, model_path: 'tiny:student-b'}]"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.teacher_model_path=tiny:teacher"], "model.teacher_model_path and teachers: are two ways"),
    (["teachers.route_key=null"], "teachers.mode = route needs teachers.route_key"),
    (["teachers.members=[{name: a, model_path: 'tiny:teacher'}, {name: a, model_path: 'tiny:teacher'}]"],
     r"the names \['a'\] are used more than once"),
    (["teachers.default=mul"], "teachers.default = 'mul' names no teacher"),
    (["teachers.mode=mixture"], "teachers.route_key is for teachers.mode = route"),
    (["teachers.members=[{name: a, backend: remote}]"], r"teachers.members\[0\].backend = remote needs "
                                                        r"teachers.members\[0\].remote.url"),
    (["teachers.members=[{name: a}]"], r"teachers.members\[0\].model_path is required"),
    (["teachers.mode=mixture", "teachers.route_key=null",
      "teachers.members=[{name: a, model_path: 'tiny:teacher', loss_fn: {type: topk}}]"],
     r"teachers.members\[0\].loss_fn: a mixture compares the student with one mixed distribution"),
    (["teachers.members=[{name: a, model_path: 'tiny:teacher'}, "
      "{name: b, model_path: 'tiny:teacher', loss_fn: {type: topk, fused_lm_head: false}}]"],
     r"set teachers.members\[1\].loss_fn.fused_lm_head so that both agree"),
    (["distillation.lambda=0.5", "teachers.members=[{name: a, model_path: 'tiny:teacher'}, "
      "{name: b, model_path: 'tiny:teacher', loss_fn: {type: sampled_token}}]"],
     r"teachers.members\[1\].loss_fn.type = sampled_token needs the student's own samples"),
    (["teachers.members=[{name: a, model_path: 'tiny:teacher', loss_fn: {type: full_vocab, kl_typo: forward}}]"],
     r"teachers.members.0.loss_fn.full_vocab.kl_typo|kl_typo"),
])
def test_several_teacher_config_mistakes_name_their_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MasterConfig, TINY_CONFIG, [*TWO_TEACHERS, *overrides])


# ------------------------------------------------------------------ a real run


def _write_task_data(path, count: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            x, y = 10 + (7 * i) % 80, 3 + (5 * i) % 9
            sign, answer, task = ("+", x + y, "add") if i % 3 else ("-", x - y, "sub")
            handle.write(json.dumps({
                "messages": [{"role": "user", "content": f"What is {x} {sign} {y}?"},
                             {"role": "assistant", "content": f"{x} {sign} {y} = {answer}. The answer is \\boxed{{{answer}}}."}],
                "ground_truth": str(answer), "task": task}) + "\n")


def test_a_routed_run_sends_every_example_to_its_teacher_and_logs_each_teachers_metrics(tmp_path):
    _write_task_data(tmp_path / "train.jsonl", 24)
    _write_task_data(tmp_path / "val.jsonl", 6)
    config = load_config(MasterConfig, TINY_CONFIG, [
        *TWO_TEACHERS, f"output_dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.val_path={tmp_path / 'val.jsonl'}", "training.max_num_steps=2", "training.val_freq=2",
        "logger.console=false", "distillation.lambda=0.5",
    ])
    components = setup(config)
    seen: dict[str, list[str]] = {"add": [], "sub": []}
    group = components.teacher_policy
    assert isinstance(group, RoutedTeachers)
    for name, member in zip(group.names, group.members, strict=True):
        original = member.score

        def spy(data, request, name=name, original=original):
            seen[name] += [components.tokenizer.decode(row[: int(n)]) for row, n in
                           zip(data["input_ids"], data["prompt_lengths"], strict=True)]
            return original(data, request)

        member.score = spy
    try:
        distillation_train(components)
    finally:
        components.close()
    assert seen["add"] and seen["sub"]
    assert all("+" in prompt and " - " not in prompt for prompt in seen["add"])
    assert all(" - " in prompt for prompt in seen["sub"])
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/loss" in record]
    assert len(steps) == 2
    for record in steps:
        shares = record["train/teacher/add/token_share"] + record["train/teacher/sub/token_share"]
        assert shares == pytest.approx(1.0)
        assert record["timing/teacher/add"] > 0 and record["timing/teacher/sub"] > 0
        assert record["train/teacher/add/kl_forward"] > 0 and record["train/teacher/sub/kl_reverse"] > 0
    assert any("val/kl_forward" in record for record in records)


def test_a_routed_run_asks_each_teacher_for_its_own_signal(tmp_path):
    _write_task_data(tmp_path / "train.jsonl", 24)
    _write_task_data(tmp_path / "val.jsonl", 6)
    config = load_config(MasterConfig, TINY_CONFIG, [
        *TWO_TEACHERS, f"output_dir={tmp_path / 'run'}", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.val_path={tmp_path / 'val.jsonl'}", "training.max_num_steps=2", "training.val_freq=2",
        "logger.console=false",
        "teachers.members=[{name: add, model_path: 'tiny:teacher'}, "
        "{name: sub, model_path: 'tiny:student-b', loss_fn: {type: topk, k: 4}}]",
    ])
    components = setup(config)
    asked: dict[str, set[type]] = {"add": set(), "sub": set()}
    group = components.teacher_policy
    assert isinstance(group, RoutedTeachers)
    for name, member in zip(group.names, group.members, strict=True):
        original = member.score

        def spy(data, request, name=name, original=original):
            asked[name].add(type(request))
            return original(data, request)

        member.score = spy
    try:
        distillation_train(components)
    finally:
        components.close()
    # Training asks each its own signal; validation asks both for the full vocabulary (its KL metrics).
    assert asked["add"] == {FullVocabRequest} and asked["sub"] == {TopKRequest, FullVocabRequest}
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "train/loss" in record]
    assert len(steps) == 2 and all(math.isfinite(record["train/loss"]) for record in steps)
    assert all(record["train/teacher/sub/kl_reverse"] > 0 for record in steps)
