"""The loss base class and its variants.

* each ``loss_fn.type`` is one registered config class that builds one loss class
  (``loss_fn.build()``), and asks the teacher for what that loss asks for;
* a new divergence is one class overriding one method: a subclass of ``FullVocabLossFn``
  that defines only ``token_divergence`` has the value and gradient of a float64
  reference worked out by hand, and gets everything else from the base class: row
  selection, global normalisation, the fused path (equal to the unfused one), off-policy
  row weights and the teacher metrics;
* every variant survives pickling (losses are sent to Ray workers).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from pydantic import TypeAdapter

from opd.kernels.fused_lm_head import LMHeadInput
from opd.losses.config import LOSS_CLASSES, LOSS_VARIANTS, LossFnConfig
from opd.losses.distillation_losses import FullVocabLossFn, JSDLossFn, KLLossFn, TokenLossFn
from opd.losses.nll import NLLLossFn
from opd.losses.off_policy import OffPolicyCorrection
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.decoding import GenerateStrategyConfig

B, L, V, D = 2, 6, 7, 5
SAMPLED = OffPolicyCorrection(
    2.0, None, None, GenerateStrategyConfig(decoding_method="top_p", temperature=1.0, top_p=1.0)
)


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L, D, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, D, generator=generator, dtype=torch.float64)
    teacher_logits = torch.randn(B, L, V, generator=generator, dtype=torch.float64) * 2
    token_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float64)
    input_ids = torch.randint(0, V, (B, L), generator=generator)
    return hidden, weight, teacher_logits, {"token_mask": token_mask, "input_ids": input_ids}


def _run(loss_fn, teacher_output, fused: bool, data=None, seed: int = 0):
    """(loss, gradient of the hidden states, metrics) of one call, fused or on logits."""
    hidden, weight, _, default_data = _inputs(seed)
    hidden.requires_grad_(True)
    student = LMHeadInput(hidden, weight) if fused else hidden @ weight.T
    loss, metrics = loss_fn(student, data or default_data, 20, 5, teacher_output=teacher_output)
    loss.backward()
    return loss.detach(), hidden.grad, metrics


def test_each_loss_type_builds_the_class_its_registry_names():
    assert set(LOSS_CLASSES) == set(LOSS_VARIANTS)
    for loss_type, config_class in LOSS_VARIANTS.items():
        built = config_class().build(V, "cpu")
        assert type(built) is LOSS_CLASSES[loss_type], loss_type
        assert built.teacher_request == config_class().teacher_request(V)


def test_the_loss_fn_union_is_made_from_the_registered_configs():
    parse = TypeAdapter(LossFnConfig).validate_python
    for loss_type, config_class in LOSS_VARIANTS.items():
        assert type(parse({"type": loss_type})) is config_class
        assert LOSS_CLASSES[loss_type] is config_class.loss_class
    assert type(parse({})) is LOSS_VARIANTS["full_vocab"]  # a section without type is the default objective


def test_a_full_vocabulary_divergence_has_one_abstract_method():
    assert FullVocabLossFn.__abstractmethods__ == frozenset({"token_divergence"})


class _SquaredProbabilityGap(FullVocabLossFn):
    """A divergence the kernels do not know: Σ_v (P(v) − Q(v))², with no closed form; one method."""

    def token_divergence(self, student_log_probs, teacher_log_probs):
        return ((teacher_log_probs.exp() - student_log_probs.exp()) ** 2).sum(-1)


def test_a_divergence_defined_by_one_method_has_the_value_and_gradient_worked_out_by_hand():
    generator = torch.Generator().manual_seed(7)
    temperature, tokens = 1.7, 20
    student = (torch.randn(B, L, V, generator=generator, dtype=torch.float64) * 2).requires_grad_(True)
    teacher = torch.randn(B, L, V, generator=generator, dtype=torch.float64) * 2
    _, _, _, data = _inputs()
    loss, _ = _SquaredProbabilityGap(temperature=temperature)(student, data, tokens, B, teacher_output=teacher)
    (grad,) = torch.autograd.grad(loss, student)
    # By hand, at each position whose next token carries loss: q = softmax(s / T), p = softmax(t / T),
    # D = Σ_v (p_v − q_v)², ∂D/∂s_j = (2 / T) · q_j · ((q_j − p_j) − Σ_v q_v (q_v − p_v)); elsewhere 0.
    expected_loss = torch.zeros((), dtype=torch.float64)
    expected_grad = torch.zeros_like(teacher)
    for b in range(B):
        for t in range(L - 1):
            if data["token_mask"][b, t + 1] == 0:
                continue
            q = torch.softmax(student[b, t].detach() / temperature, -1)
            p = torch.softmax(teacher[b, t] / temperature, -1)
            expected_loss += ((p - q) ** 2).sum() / tokens
            expected_grad[b, t] = 2 / temperature * q * ((q - p) - (q * (q - p)).sum()) / tokens
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-15)


def test_a_variant_that_overrides_only_the_divergence_gets_rows_normalisation_and_the_fused_path():
    hidden, weight, teacher_logits, data = _inputs()
    loss_fn = _SquaredProbabilityGap(temperature=1.5, chunk_size=2, metrics_topk=3)
    assert loss_fn.teacher_request.prefer_hidden_states is False
    loss, grad, metrics = _run(loss_fn, teacher_logits, fused=False)
    # By hand: the positions whose next token is a response token, over the global token count (20).
    mask = data["token_mask"][:, 1:].bool()
    q = torch.softmax((hidden @ weight.T)[:, :-1][mask] / 1.5, -1)
    p = torch.softmax(teacher_logits[:, :-1][mask] / 1.5, -1)
    torch.testing.assert_close(loss, ((p - q) ** 2).sum() / 20, rtol=1e-12, atol=0)
    # The teacher metrics come from the base class, as for the built-in variants.
    reference = KLLossFn("forward", temperature=1.5, metrics_topk=3)
    _, _, kl_metrics = _run(reference, teacher_logits, fused=False)
    assert metrics["kl_forward"] == pytest.approx(kl_metrics["kl_forward"], rel=1e-12)
    assert metrics["topk_overlap"] == pytest.approx(kl_metrics["topk_overlap"], rel=1e-12)
    assert metrics["num_valid_tokens"] == float(mask.sum())
    # The fused path (autograd chunk by chunk) equals the logits path.
    fused_loss, fused_grad, fused_metrics = _run(loss_fn, teacher_logits, fused=True)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fused_grad, grad, rtol=1e-10, atol=1e-14)
    assert fused_metrics["kl_reverse"] == pytest.approx(metrics["kl_reverse"], rel=1e-12)
    with pytest.raises(NotImplementedError, match="no closed-form gradient"):
        loss_fn._divergence_with_grad(teacher_logits[0], teacher_logits[0])


def test_a_variant_gets_the_off_policy_row_weights_from_the_base_class():
    _, _, teacher_logits, data = _inputs()
    stale = {**data, "staleness": torch.tensor([1, 0]), "generation_logprobs": torch.full((B, L), -1.0)}
    plain = _run(_SquaredProbabilityGap(), teacher_logits, fused=False, data=stale)
    weighted = _run(_SquaredProbabilityGap(off_policy=SAMPLED), teacher_logits, fused=False, data=stale)
    assert "is_ratio_mean" in weighted[2] and "is_ratio_mean" not in plain[2]
    assert not torch.allclose(weighted[0], plain[0])  # row 0 is stale: its positions are reweighted


@pytest.mark.parametrize(
    "make",
    [
        lambda: KLLossFn("mixed", 0.2, fused_lm_head=True, chunk_size=3),
        lambda: JSDLossFn(0.7, fused_lm_head=True),
        lambda: NLLLossFn(fused_lm_head=True, chunk_size=2),
        lambda: SampledTokenLossFn(discount=0.5, fused_lm_head=True),
    ],
    ids=["kl", "jsd", "nll", "sampled_token"],
)
def test_every_variant_pickles_and_computes_the_same_after(make):
    loss_fn = make()
    copy = pickle.loads(pickle.dumps(loss_fn))
    assert type(copy) is type(loss_fn) and isinstance(copy, TokenLossFn)
    _, _, teacher_logits, data = _inputs()
    teacher: object = teacher_logits
    if isinstance(loss_fn, SampledTokenLossFn):
        teacher = torch.log_softmax(teacher_logits, -1).gather(-1, data["input_ids"].unsqueeze(-1)).squeeze(-1)
        data = {**data, "generation_logprobs": torch.full((B, L), -1.5, dtype=torch.float64)}
    expected = _run(loss_fn, teacher, fused=True, data=data)
    got = _run(copy, teacher, fused=True, data=data)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
