"""``loss_fn.token_clip``: each position's divergence capped, in float64 against a plain reference.

The reference is the plain computation the cap is defined by: the unfused per-position
divergence of the loss's own kernel (:func:`token_kl`, :func:`generalized_jsd`,
:func:`topk_token_kl`) on the loss positions, clamped at the cap, summed and divided by
the global token count, differentiated by autograd. For every divergence (forward,
reverse and mixed KL, the JSD, the top-k KL) and both paths (logits; the fused LM head,
whose full-vocabulary losses take the closed-form gradient and the top-k loss autograd,
in several chunks), the clipped loss, the gradients of the hidden states and of the
head weight, and ``clipped_token_fraction`` equal the reference's (1e-12). Edge cases: a
cap below every position's divergence leaves exactly zero gradient and a loss of cap ×
positions / tokens; a cap above every one gives the unclipped loss and gradients bit for
bit. Values out of range are refused, naming the argument or the key.
"""

from __future__ import annotations

import re

import pytest
import torch
from opd_test_helpers import REPO_ROOT

from opd.data.sequences import shift_token_mask
from opd.distillation.config import MasterConfig
from opd.kernels.topk_rest import rest_logprobs_outside
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.divergences import generalized_jsd, token_kl, topk_token_kl
from opd.models.interfaces import TopKLogprobs
from opd.models.lm_head import LMHeadInput
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

B, L, V, D, K = 3, 7, 11, 6, 4
GLOBAL_TOKENS = 20  # more than this micro-batch's loss positions: another micro-batch has the rest
TEMPERATURE = 1.3
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"


def _inputs():
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, L, D, generator=generator, dtype=torch.float64)
    weight = torch.randn(V, D, generator=generator, dtype=torch.float64)
    teacher_logits = torch.randn(B, L, V, generator=generator, dtype=torch.float64) * 3
    token_mask = torch.tensor(
        [[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0]], dtype=torch.float64
    )
    return hidden, weight, teacher_logits, {"token_mask": token_mask}


def _topk_answer(teacher_logits: torch.Tensor) -> TopKLogprobs:
    log_p = torch.log_softmax(teacher_logits / TEMPERATURE, dim=-1)
    top = log_p.topk(K, dim=-1)
    return TopKLogprobs(top.values, top.indices, rest_logprobs_outside(log_p, top.indices))


# name -> (loss built with a cap, the plain per-position divergence of (student logits, teacher logits))
VARIANTS = {
    "forward": (
        lambda clip: KLLossFn("forward", temperature=TEMPERATURE, token_clip=clip),
        lambda q, p: token_kl(q, p, "forward", temperature=TEMPERATURE),
    ),
    "reverse": (
        lambda clip: KLLossFn("reverse", temperature=TEMPERATURE, token_clip=clip),
        lambda q, p: token_kl(q, p, "reverse", temperature=TEMPERATURE),
    ),
    "mixed": (
        lambda clip: KLLossFn("mixed", 0.3, temperature=TEMPERATURE, token_clip=clip),
        lambda q, p: token_kl(q, p, "mixed", 0.3, temperature=TEMPERATURE),
    ),
    "jsd": (
        lambda clip: JSDLossFn(0.3, temperature=TEMPERATURE, token_clip=clip),
        lambda q, p: generalized_jsd(q, p, 0.3, temperature=TEMPERATURE),
    ),
    "topk_forward": (
        lambda clip: TopKKLLossFn("forward", k=K, temperature=TEMPERATURE, token_clip=clip),
        None,  # the top-k kernel, below
    ),
    "topk_reverse": (
        lambda clip: TopKKLLossFn("reverse", k=K, temperature=TEMPERATURE, token_clip=clip),
        None,
    ),
}


def _teacher_output(name: str, teacher_logits: torch.Tensor):
    return _topk_answer(teacher_logits) if name.startswith("topk") else teacher_logits


def _plain_divergence(name: str, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The unfused per-position divergence at the loss positions, ``[N]``."""
    mask = shift_token_mask(_inputs()[3]["token_mask"]).bool()
    rows = student_logits[:, :-1][mask]
    if not name.startswith("topk"):
        return VARIANTS[name][1](rows, teacher_logits[:, :-1][mask])
    answer = _topk_answer(teacher_logits)
    kl_type = name.removeprefix("topk_")
    return topk_token_kl(
        rows,
        answer.logprobs[:, :-1][mask],
        answer.ids[:, :-1][mask],
        kl_type,
        temperature=TEMPERATURE,
        teacher_rest_logprobs=answer.rest_logprobs[:, :-1][mask],
    )


def _reference(name: str, cap: float | None):
    """(loss, ∂/∂hidden, ∂/∂weight, clipped fraction) of the clamped plain divergence."""
    hidden, weight, teacher_logits, _ = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    per_position = _plain_divergence(name, hidden @ weight.T, teacher_logits)
    clipped = per_position if cap is None else per_position.clamp(max=cap)
    loss = clipped.sum() / GLOBAL_TOKENS
    loss.backward()
    fraction = 0.0 if cap is None else float((per_position.detach() > cap).sum()) / GLOBAL_TOKENS
    return loss.detach(), hidden.grad, weight.grad, fraction


def _run(name: str, cap: float | None, fused: bool):
    """(loss, ∂/∂hidden, ∂/∂weight, metrics) of the loss object, on logits or fused in chunks of 2 positions."""
    hidden, weight, teacher_logits, data = _inputs()
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss_fn = VARIANTS[name][0](cap)
    loss_fn.fused_lm_head = fused
    loss_fn.chunk_size = 2  # several chunks: the count is added up across them
    student = LMHeadInput(hidden, weight) if fused else hidden @ weight.T
    loss, metrics = loss_fn(student, data, GLOBAL_TOKENS, B, teacher_output=_teacher_output(name, teacher_logits))
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, metrics


def _divergences(name: str) -> torch.Tensor:
    hidden, weight, teacher_logits, _ = _inputs()
    return _plain_divergence(name, hidden @ weight.T, teacher_logits).detach()


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_clipped_loss_equals_the_clamped_plain_divergence(name, fused):
    values = _divergences(name)
    cap = float(values.median())  # some positions above the cap, some below
    over = int((values > cap).sum())
    assert 0 < over < values.numel()
    expected_loss, expected_hidden, expected_weight, expected_fraction = _reference(name, cap)
    loss, grad_hidden, grad_weight, metrics = _run(name, cap, fused)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_hidden, expected_hidden, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_weight, expected_weight, rtol=0, atol=1e-12)
    assert metrics["clipped_token_fraction"] == pytest.approx(expected_fraction, abs=1e-15)
    assert metrics["clipped_token_fraction"] == pytest.approx(over / GLOBAL_TOKENS, abs=1e-15)
    assert metrics["loss"] == pytest.approx(float(expected_loss), abs=1e-12)
    # The clip changed something: the unclipped loss is larger.
    assert float(_reference(name, None)[0]) > float(expected_loss) + 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_cap_below_every_divergence_leaves_no_gradient(name, fused):
    values = _divergences(name)
    cap = float(values.min()) / 2
    loss, grad_hidden, grad_weight, metrics = _run(name, cap, fused)
    assert not grad_hidden.any() and not grad_weight.any()
    torch.testing.assert_close(loss, torch.tensor(cap * values.numel() / GLOBAL_TOKENS, dtype=loss.dtype),
                               rtol=0, atol=1e-15)
    assert metrics["clipped_token_fraction"] == pytest.approx(values.numel() / GLOBAL_TOKENS, abs=1e-15)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_cap_above_every_divergence_changes_nothing(name, fused):
    cap = float(_divergences(name).max()) * 2
    loss, grad_hidden, grad_weight, metrics = _run(name, cap, fused)
    plain_loss, plain_hidden, plain_weight, plain_metrics = _run(name, None, fused)
    assert torch.equal(loss, plain_loss)
    assert torch.equal(grad_hidden, plain_hidden) and torch.equal(grad_weight, plain_weight)
    assert metrics["clipped_token_fraction"] == 0.0
    assert "clipped_token_fraction" not in plain_metrics
    assert {key: value for key, value in metrics.items() if key != "clipped_token_fraction"} == plain_metrics


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_cap_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="token_clip must be a finite number > 0"):
        KLLossFn(token_clip=value)


@pytest.mark.parametrize("overrides, message", [
    (["loss_fn.token_clip=0"], "loss_fn.token_clip = 0: Input should be greater than 0"),
    (["loss_fn.type=topk", "loss_fn.token_clip=.inf"], "loss_fn.token_clip = inf: Input should be a finite number"),
    (["loss_fn.type=sampled_token", "loss_fn.token_clip=2"], "loss_fn.token_clip"),
])
def test_config_mistakes_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}", *overrides])


def test_the_config_key_reaches_the_loss():
    config = load_config(MasterConfig, TINY_CONFIG, ["loss_fn.type=jsd", "loss_fn.token_clip=1.5"])
    assert config.loss_fn.build(V, "cpu").token_clip == 1.5
