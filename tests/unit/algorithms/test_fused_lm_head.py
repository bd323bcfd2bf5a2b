"""The fused, chunked LM-head loss against the plain path that materialises the logits.

Every divergence opd offers is computed both ways on random hidden states and heads, for
chunk sizes from one position to more than all of them: loss values and the gradients of
the hidden states, the head weight and its bias must agree to rounding (float64: 1e-12).
The same with heads that transform their logits (a multiplier, Gemma 2's soft cap, up to
a cap so small that tanh saturates). Then the same through real tiny Hugging Face models:
the policy's fused forward, the in-process teacher's hidden states / top-k / token
log-probs, and one optimizer step. (Every decoder family: ``tests/unit/models/test_model_families.py``.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import attention_mask_from_lengths, pack_sequences
from opd.kernels import fused_lm_head
from opd.kernels.fused_lm_head import add_weight_gradient, chunked_lm_head_loss
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.divergences import full_vocab_divergence_with_grad, generalized_jsd, token_kl, topk_token_kl
from opd.losses.sampled_token import SampledTokenLossFn, sampled_token_pg_loss
from opd.models import lm_head
from opd.models.lm_head import (
    LMHeadInput,
    default_chunk_rows,
    final_hidden_states,
    logit_transform_of,
    map_log_softmax_chunks,
    output_head_of,
    output_layer_of,
    transform_logits,
)
from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy, OptimizerConfig, student_output
from opd.teachers.local_teacher import LocalTeacher

N, D, V = 11, 6, 17


def random_case(dtype: torch.dtype, seed: int = 0, bias: bool = True, n: int = N):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, D, generator=generator, dtype=dtype)
    weight = torch.randn(V, D, generator=generator, dtype=dtype)
    head_bias = torch.randn(V, generator=generator, dtype=dtype) if bias else None
    teacher_hidden = torch.randn(n, D + 2, generator=generator, dtype=dtype) * 2
    teacher_weight = torch.randn(V, D + 2, generator=generator, dtype=dtype)
    weights = torch.rand(n, generator=generator, dtype=torch.float64)
    return hidden, weight, head_bias, teacher_hidden, teacher_weight, weights


def topk_of(logits: torch.Tensor, k: int, temperature: float = 1.0):
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    return values.to(logits.dtype), ids


CLOSED_FORM_LOSSES = {"kl": lambda: KLLossFn("mixed", 0.3, temperature=1.4), "jsd": lambda: JSDLossFn(0.6, temperature=1.4)}
"""The full-vocabulary losses with a closed-form gradient, by name."""


# Each divergence as (name, fn(student_logits, teacher_logits, targets) -> (divergence, row inputs)).
def _kl(kl_type):
    return lambda teacher_logits: (functools.partial(_call_token_kl, kl_type), (teacher_logits,))


def _call_token_kl(kl_type, student, teacher):
    return token_kl(student, teacher, kl_type, 0.3, 1.7)


def _jsd(student, teacher):
    return generalized_jsd(student, teacher, 0.3, 0.8)


def _topk(tail, kl_type, student, logprobs, ids):
    return topk_token_kl(student, logprobs, ids, kl_type, 0.4, tail=tail, temperature=1.3)


def _pg(student, targets, sampler_logprobs, advantages):
    log_q = torch.log_softmax(student, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return sampled_token_pg_loss(log_q, sampler_logprobs, advantages, 0.2)


def divergence_cases(teacher_logits: torch.Tensor):
    generator = torch.Generator().manual_seed(7)
    n = teacher_logits.shape[0]
    targets = torch.randint(0, V, (n,), generator=generator)
    sampler = torch.log_softmax(torch.randn(n, V, generator=generator, dtype=teacher_logits.dtype), -1)[range(n), targets]
    advantages = torch.randn(n, generator=generator, dtype=teacher_logits.dtype)
    cases = {f"kl-{kl_type}": (functools.partial(_call_token_kl, kl_type), (teacher_logits,))
             for kl_type in ("forward", "reverse", "mixed")}
    cases["jsd"] = (_jsd, (teacher_logits,))
    for k in (1, 5, V):
        logprobs, ids = topk_of(teacher_logits, k, 1.3)
        for tail in (True, False):
            cases[f"topk{k}-{'tail' if tail else 'renorm'}"] = (
                functools.partial(_topk, tail, "mixed"), (logprobs, ids))
    cases["sampled-token"] = (_pg, (targets, sampler, advantages))
    return cases


def plain_loss(hidden, weight, bias, divergence, row_inputs, weights, multiplier=1.0, softcap=None):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:  # as transformers' Gemma 2 writes it
        logits = torch.tanh(logits / softcap) * softcap
    return (divergence(logits, *row_inputs) * weights.to(logits.dtype)).sum()


def gradients(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_rows", [1, 3, N, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_fused_equals_plain_for_every_divergence(dtype, chunk_rows):
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(dtype)
    teacher_logits = teacher_hidden @ teacher_weight.T
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
    for name, (divergence, row_inputs) in divergence_cases(teacher_logits).items():
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        expected = plain_loss(*leaves, divergence, row_inputs, weights)
        expected_grads = gradients(expected, leaves)
        fused_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        fused = chunked_lm_head_loss(LMHeadInput(*fused_leaves), divergence, row_inputs, weights, chunk_rows)
        fused_grads = gradients(fused, fused_leaves)
        torch.testing.assert_close(fused, expected.to(fused.dtype), **tolerance, msg=name)
        for got, want, what in zip(fused_grads, expected_grads, ("hidden", "weight", "bias")):
            torch.testing.assert_close(got, want, **tolerance, msg=f"{name}: d/d{what}")


# (multiplier, soft cap): the raw logits of random_case are about ±2.5 (up to ±8).
TRANSFORMS = [(2.5, None), (1.0, 3.0), (0.4, 1.5), (3.0, 0.05)]
TRANSFORM_IDS = ["scale", "cap", "scale-cap", "saturated"]


@pytest.mark.parametrize("chunk_rows", [1, 4, 64])
@pytest.mark.parametrize(("multiplier", "softcap"), TRANSFORMS, ids=TRANSFORM_IDS)
def test_fused_transformed_head_equals_plain_for_every_divergence(multiplier, softcap, chunk_rows):
    """A student head with a logit multiplier and a soft cap: the fused loss differentiates through both."""
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=21)
    teacher_logits = teacher_hidden @ teacher_weight.T
    for name, (divergence, row_inputs) in divergence_cases(teacher_logits).items():
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        expected = plain_loss(*leaves, divergence, row_inputs, weights, multiplier, softcap)
        expected_grads = gradients(expected, leaves)
        fused_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        head = LMHeadInput(*fused_leaves, logit_multiplier=multiplier, logit_softcap=softcap)
        fused = chunked_lm_head_loss(head, divergence, row_inputs, weights, chunk_rows)
        torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12, msg=name)
        for got, want, what in zip(gradients(fused, fused_leaves), expected_grads, ("hidden", "weight", "bias")):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{name}: d/d{what}")


def test_saturated_soft_cap_is_saturated():
    """The "saturated" case above is one: most logits sit at ±cap, where tanh's slope rounds to 0."""
    hidden, weight, bias, *_ = random_case(torch.float64, seed=21)
    raw = torch.nn.functional.linear(hidden, weight, bias)
    logits = transform_logits(raw, 3.0, 0.05)
    assert float(logits.abs().max()) <= 0.05
    slope = 1 - torch.tanh(3.0 * raw / 0.05) ** 2
    assert float((slope == 0).double().mean()) > 0.5 and float((slope > 1e-3).double().mean()) > 0.0


@pytest.mark.parametrize(("multiplier", "softcap"), TRANSFORMS, ids=TRANSFORM_IDS)
@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_closed_form_through_a_transformed_head_equals_plain(divergence, multiplier, softcap):
    """``value_and_grad``'s gradient of the transformed logits, chained through the transform's derivative."""
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=22)
    teacher_logits = teacher_hidden @ teacher_weight.T
    loss_fn = CLOSED_FORM_LOSSES[divergence]()
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = plain_loss(*leaves, loss_fn._divergence, (teacher_logits,), weights, multiplier, softcap)
    expected_grads = gradients(expected, leaves)
    fused_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    head = LMHeadInput(*fused_leaves, logit_multiplier=multiplier, logit_softcap=softcap)
    fused = chunked_lm_head_loss(head, loss_fn._divergence, (teacher_logits,), weights, 3,
                                 value_and_grad=loss_fn._divergence_with_grad)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(gradients(fused, fused_leaves), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


CLOSED_FORMS = [("forward", None), ("reverse", None), ("mixed", None), ("mixed0", None), ("mixed1", None),
                ("-", 0.0), ("-", 0.3), ("-", 0.9), ("-", 1.0)]


@pytest.mark.parametrize(("kl_type", "beta"), CLOSED_FORMS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("scale", [1.0, 40.0], ids=["normal", "extreme"])
def test_closed_form_gradient_equals_autograd(kl_type, beta, temperature, scale):
    generator = torch.Generator().manual_seed(13)
    student = torch.randn(7, V, generator=generator, dtype=torch.float64) * scale
    teacher = torch.randn(7, V, generator=generator, dtype=torch.float64) * scale
    teacher[0, :5] = float("-inf")  # a teacher that rules tokens out (P = 0 there)
    weight = {"mixed0": 0.0, "mixed1": 1.0}.get(kl_type, 0.3)
    kl = "mixed" if kl_type.startswith("mixed") else kl_type
    has_reverse_kl = beta == 1.0 if beta is not None else (kl == "reverse" or (kl == "mixed" and weight != 1.0))
    if has_reverse_kl:
        teacher[0, :5] = -30.0 * scale  # reverse KL is +inf where P = 0 and Q > 0: very unlikely instead
    leaf = student.clone().requires_grad_(True)
    expected = (generalized_jsd(leaf, teacher, beta, temperature) if beta is not None
                else token_kl(leaf, teacher, kl, weight, temperature))
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    values, grad = full_vocab_divergence_with_grad(student, teacher, kl if beta is None else "forward", weight,
                                                   temperature, beta)
    torch.testing.assert_close(values, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(values).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("divergence", ["kl", "jsd"])
def test_fused_with_closed_form_equals_plain(divergence):
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=12)
    teacher_logits = teacher_hidden @ teacher_weight.T
    loss_fn = CLOSED_FORM_LOSSES[divergence]()
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = plain_loss(*leaves, loss_fn._divergence, (teacher_logits,), weights)
    expected_grads = gradients(expected, leaves)
    fused_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    fused = chunked_lm_head_loss(LMHeadInput(*fused_leaves), loss_fn._divergence, (teacher_logits,), weights, 3,
                                 value_and_grad=loss_fn._divergence_with_grad)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(gradients(fused, fused_leaves), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_teacher_logits_made_per_chunk_equal_given_logits():
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=3)
    teacher_head = LMHeadInput(teacher_hidden, teacher_weight)
    divergence = functools.partial(_call_token_kl, "forward")
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = plain_loss(*leaves, divergence, (teacher_head.logits(),), weights)
    expected_grads = gradients(expected, leaves)
    fused = chunked_lm_head_loss(LMHeadInput(hidden.requires_grad_(True), weight.requires_grad_(True),
                                             bias.requires_grad_(True)), divergence, (teacher_head,), weights, 4)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(gradients(fused, (hidden, weight, bias)), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.4, 1.5)], ids=["plain", "scale-cap"])
def test_gradients_match_central_differences(multiplier, softcap):
    """gradcheck's test, done by hand: ``torch.autograd.gradcheck`` runs backward twice on
    one graph, which the fused function refuses (it hands its gradients over to save a
    copy of the weight gradient). Central differences along random directions instead."""
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=5, n=5)
    teacher_logits = teacher_hidden @ teacher_weight.T
    divergence = functools.partial(_call_token_kl, "mixed")

    def fused(h, w, b):
        head = LMHeadInput(h, w, b, logit_multiplier=multiplier, logit_softcap=softcap)
        return chunked_lm_head_loss(head, divergence, (teacher_logits,), weights, 2)

    inputs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    analytic = torch.autograd.grad(fused(*inputs), inputs)
    generator = torch.Generator().manual_seed(9)
    step = 1e-6
    with torch.no_grad():
        for _ in range(4):
            directions = [torch.randn(t.shape, generator=generator, dtype=torch.float64) for t in inputs]
            plus = fused(*[t + step * d for t, d in zip(inputs, directions)])
            minus = fused(*[t - step * d for t, d in zip(inputs, directions)])
            numeric = float((plus - minus) / (2 * step))
            predicted = sum(float((g * d).sum()) for g, d in zip(analytic, directions))
            assert numeric == pytest.approx(predicted, rel=1e-6, abs=1e-9)


def test_upstream_gradient_scales_the_precomputed_gradients():
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=2)
    teacher_logits = teacher_hidden @ teacher_weight.T
    divergence = functools.partial(_call_token_kl, "reverse")
    h = hidden.clone().requires_grad_(True)
    (grad_once,) = torch.autograd.grad(chunked_lm_head_loss(LMHeadInput(h, weight, bias), divergence,
                                                            (teacher_logits,), weights, 3), h)
    (grad_scaled,) = torch.autograd.grad(-2.5 * chunked_lm_head_loss(LMHeadInput(h, weight, bias), divergence,
                                                                     (teacher_logits,), weights, 3), h)
    torch.testing.assert_close(grad_scaled, -2.5 * grad_once, rtol=1e-13, atol=1e-14)


def test_a_second_backward_pass_is_refused_not_wrong():
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=8)
    h = hidden.clone().requires_grad_(True)
    loss = chunked_lm_head_loss(LMHeadInput(h, weight, bias), functools.partial(_call_token_kl, "forward"),
                                (teacher_hidden @ teacher_weight.T,), weights)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_no_positions_gives_zero_loss_and_zero_gradients():
    hidden, weight, bias, _, _, _ = random_case(torch.float64, n=0)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss = chunked_lm_head_loss(LMHeadInput(*leaves), functools.partial(_call_token_kl, "forward"),
                                (torch.zeros(0, V, dtype=torch.float64),), torch.zeros(0, dtype=torch.float64))
    assert float(loss.detach()) == 0.0
    for grad in gradients(loss, leaves):
        assert float(grad.abs().sum()) == 0.0


def test_padded_output_rows_are_never_used_and_get_no_gradient():
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float64, seed=4)
    teacher_logits = teacher_hidden @ teacher_weight.T
    padded_weight = torch.cat([weight, torch.full((3, D), 1e3, dtype=torch.float64)]).requires_grad_(True)
    padded_bias = torch.cat([bias, torch.full((3,), 1e3, dtype=torch.float64)]).requires_grad_(True)
    divergence = functools.partial(_call_token_kl, "forward")
    fused = chunked_lm_head_loss(LMHeadInput(hidden, padded_weight, padded_bias, vocab_size=V), divergence,
                                 (teacher_logits,), weights, 4)
    expected = plain_loss(hidden, weight, bias, divergence, (teacher_logits,), weights)
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    grad_weight, grad_bias = torch.autograd.grad(fused, [padded_weight, padded_bias])
    assert float(grad_weight[V:].abs().sum()) == 0.0 and float(grad_bias[V:].abs().sum()) == 0.0


def test_extreme_logits_stay_finite_in_the_fused_path():
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float32, seed=6)
    hidden = (hidden * 300).requires_grad_(True)  # logits in the thousands
    teacher_logits = teacher_hidden @ teacher_weight.T * 500
    for name, (divergence, row_inputs) in divergence_cases(teacher_logits).items():
        loss = chunked_lm_head_loss(LMHeadInput(hidden, weight, bias), divergence, row_inputs, weights, 4)
        (grad,) = torch.autograd.grad(loss, hidden)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), name


def _peak_bytes(run: Callable[[], object]) -> int:
    """The peak of the tensors ``run`` holds at once (torch's MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        run()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _peak_bytes_of_a_fused_step(positions: int, chunk_rows: int, vocab: int) -> int:
    """The peak of the tensors a fused loss and its backward hold, at ``positions``."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, 8, generator=generator).requires_grad_(True)
    hidden = torch.randn(positions, 8, generator=generator).requires_grad_(True)
    targets = torch.randint(0, vocab, (positions,), generator=generator)

    def negative_log_likelihood(logits: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        return -logits.log_softmax(-1).gather(-1, chunk_targets.unsqueeze(-1)).squeeze(-1)

    def step() -> None:
        loss = chunked_lm_head_loss(
            LMHeadInput(hidden, weight), negative_log_likelihood, (targets,), torch.ones(positions), chunk_rows
        )
        loss.backward()

    return _peak_bytes(step)


def test_the_fused_loss_holds_one_chunk_at_a_time():
    # Only [positions]-sized inputs grow with the positions here (ids, weights, hidden states of width 8), so four
    # chunks must peak where one does, give or take those: a [chunk × V] tensor of one chunk kept alive through the
    # next chunk's logits (as a leftover name did before) adds a whole chunk.
    chunk_rows, vocab = 16, 4096
    one_chunk = _peak_bytes_of_a_fused_step(chunk_rows, chunk_rows, vocab)
    four_chunks = _peak_bytes_of_a_fused_step(4 * chunk_rows, chunk_rows, vocab)
    chunk_bytes = chunk_rows * vocab * 4
    assert one_chunk >= chunk_bytes  # the tracker sees the chunk's logits
    assert four_chunks - one_chunk < chunk_bytes // 4, (one_chunk, four_chunks)


def test_a_teachers_top_k_over_log_softmax_chunks_holds_one_chunk_at_a_time(monkeypatch):
    # As the fused loss: only the [positions × k] results grow with the positions, never a second [chunk × V].
    chunk_rows, vocab = 16, 4096
    monkeypatch.setattr(lm_head, "default_chunk_rows", lambda vocab_size, *_: chunk_rows)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, 8, generator=generator)

    def top_k_peak(positions: int) -> int:
        head = LMHeadInput(torch.randn(positions, 8, generator=generator), weight)
        return _peak_bytes(lambda: map_log_softmax_chunks(head, lambda log_p, _: log_p.topk(4, dim=-1)))

    one_chunk, four_chunks = top_k_peak(chunk_rows), top_k_peak(4 * chunk_rows)
    chunk_bytes = chunk_rows * vocab * 4
    assert one_chunk >= chunk_bytes
    assert four_chunks - one_chunk < chunk_bytes // 4, (one_chunk, four_chunks)


def test_default_chunk_is_128_mib_of_fp32_logits():
    assert default_chunk_rows(151_669) == 222
    assert default_chunk_rows(151_669) * 151_669 * 4 <= 129 * 2**20
    assert default_chunk_rows(455) >= 8192


# --------------------------------------------------------------------------- real models


def tiny_batch() -> BatchedDataDict:
    generator = torch.Generator().manual_seed(11)
    lengths, prompts = [9, 14, 6, 12], [4, 6, 5, 3]
    sequences = [torch.randint(3, 120, (n,), generator=generator).tolist() for n in lengths]
    return pack_sequences(sequences, prompts, 0, True)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
@pytest.mark.parametrize("loss_kind", ["kl-mixed", "jsd", "topk-tail", "topk-renorm", "sampled-token"])
def test_fused_policy_step_equals_plain_step(loss_kind, temperature):
    """One optimizer step of a real tiny student: fused and plain give the same gradients."""
    batch = tiny_batch()
    vocab = build_tiny_model("student").config.vocab_size - 5  # cut: padded output rows
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    if loss_kind == "sampled-token":
        # The sampler's log-probs: the student's own, slightly off (an older copy), so that
        # some ratios fall inside the clip range and some outside.
        generator = torch.Generator().manual_seed(1)
        student = build_tiny_model("student", dtype=torch.float64)
        with torch.no_grad():
            logits = student(input_ids=batch["input_ids"]).logits[..., :vocab]
        own = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        noise = 0.3 * torch.randn(own.shape, generator=generator, dtype=torch.float64)
        batch["generation_logprobs"] = torch.cat([torch.zeros_like(own[:, :1]), own + noise], dim=1)
        make = functools.partial(SampledTokenLossFn, discount=0.5, vocab_size=vocab, chunk_size=5)
    else:
        loss_class, options = {"kl-mixed": (KLLossFn, {"kl_type": "mixed"}), "jsd": (JSDLossFn, {"beta": 0.7}),
                               "topk-tail": (TopKKLLossFn, {"k": 4}),
                               "topk-renorm": (TopKKLLossFn, {"k": 4, "tail": False})}[loss_kind]
        make = functools.partial(loss_class, temperature=temperature, vocab_size=vocab, chunk_size=5, **options)
    results = []
    for fused in (False, True):
        model = build_tiny_model("student", dtype=torch.float64)
        policy = HFPolicy(model, OptimizerConfig(learning_rate=1e-3, max_grad_norm=None), 3, 1)
        grads: dict[str, torch.Tensor] = {}
        names = {id(p): n for n, p in model.named_parameters()}
        policy.optimizer.register_step_pre_hook(lambda opt, *_: grads.update(
            {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]}))
        loss_fn = make(fused_lm_head=fused)
        metrics = policy.train(batch, loss_fn, teacher_signal=functools.partial(teacher.score,
                                                                                request=loss_fn.teacher_request))
        results.append((metrics, grads))
    (plain_metrics, plain_grads), (fused_metrics, fused_grads) = results
    for key, value in plain_metrics.items():
        assert fused_metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert plain_metrics["grad_norm"] > 1e-3
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_final_hidden_states_through_the_head_are_the_model_logits():
    model = build_tiny_model("student", dtype=torch.float64)
    batch = tiny_batch()
    attention = attention_mask_from_lengths(batch["input_lengths"], batch["input_ids"].shape[1])
    weight, bias = output_head_of(model)
    hidden = final_hidden_states(model, batch["input_ids"], attention)
    logits = model(input_ids=batch["input_ids"], attention_mask=attention).logits
    torch.testing.assert_close(LMHeadInput(hidden, weight, bias).logits(), logits, rtol=1e-12, atol=1e-12)


def test_local_teacher_answers_agree_with_its_logits():
    teacher = LocalTeacher(build_tiny_model("teacher", dtype=torch.float64))
    batch = tiny_batch()
    logits = teacher.get_logits(batch)
    vocab = logits.shape[-1] - 7
    log_p = torch.log_softmax(logits[..., :vocab].float() / 2.0, dim=-1)
    values, ids = teacher.get_topk_logprobs(batch, 5, temperature=2.0, vocab_size=vocab)
    assert values.shape == ids.shape == (*batch["input_ids"].shape, 5)
    torch.testing.assert_close(values, log_p.topk(5, dim=-1).values, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_p.gather(-1, ids), values, rtol=1e-6, atol=1e-6)
    assert int(ids.max()) < vocab
    all_values, _ = teacher.get_topk_logprobs(batch, vocab + 50, vocab_size=vocab)  # k >= vocab: capped
    assert all_values.shape[-1] == vocab

    token_logprobs = teacher.get_token_logprobs(batch, vocab_size=vocab)
    full = torch.log_softmax(logits[..., :vocab].double(), dim=-1)
    expected = full[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    assert torch.all(token_logprobs[:, 0] == 0)
    torch.testing.assert_close(token_logprobs[:, 1:].double(), expected, rtol=1e-6, atol=1e-6)

    head = teacher.get_hidden_states(batch)
    torch.testing.assert_close(head.logits(), logits, rtol=1e-12, atol=1e-12)
    assert not head.hidden_states.is_inference() and not head.hidden_states.requires_grad


def tiny_qwen2(**config_attributes) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    for attribute, value in config_attributes.items():
        setattr(config, attribute, value)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("attribute", ["final_logit_softcapping", "logit_scale"])
def test_the_student_head_carries_its_logit_transform_and_the_bare_head_refuses_it(attribute):
    model = tiny_qwen2(**{attribute: 30.0})
    batch = BatchedDataDict(input_ids=torch.tensor([[3, 5, 7]]), input_lengths=torch.tensor([3]))
    head = student_output(model, batch, torch.device("cpu"), fused_lm_head=True)
    assert isinstance(head, LMHeadInput) and head.weight is model.lm_head.weight  # the parameter: gradients flow
    assert (head.logit_multiplier, head.logit_softcap) == ((30.0, None) if attribute == "logit_scale" else (1.0, 30.0))
    # The bare (weight, bias) pair would lose the transform: refused, with the reason.
    with pytest.raises(ValueError, match=f"config.{attribute} = 30.0, which a bare \\(weight, bias\\) head"):
        output_head_of(model, "the student")


@pytest.mark.parametrize("cap", [0, 0.0])
def test_a_soft_cap_of_zero_is_no_cap_for_the_bare_head_and_the_transform_alike(cap):
    model = tiny_qwen2(final_logit_softcapping=cap)
    assert logit_transform_of(model.config) == (1.0, None)
    weight, bias = output_head_of(model, "the student")  # nothing to lose: accepted
    assert weight is model.lm_head.weight and bias is None
    # A cap of 1 is a cap (1 · tanh(logits)): applied by the transform, so the bare head refuses it.
    capped = tiny_qwen2(final_logit_softcapping=1.0)
    assert logit_transform_of(capped.config) == (1.0, 1.0)
    with pytest.raises(ValueError, match=r"config\.final_logit_softcapping = 1\.0"):
        output_head_of(capped, "the student")


def test_a_head_opd_cannot_reproduce_is_refused_with_its_reason():
    with pytest.raises(ValueError, match=r"output_multiplier_scale = 2\.0, which opd does not apply"):
        output_layer_of(tiny_qwen2(output_multiplier_scale=2.0), "the student")
    model = tiny_qwen2()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    batch = BatchedDataDict(input_ids=torch.tensor([[3, 5, 7]]), input_lengths=torch.tensor([3]))
    with pytest.raises(ValueError, match="the student's output layer is Sequential, not a linear layer"):
        student_output(model, batch, torch.device("cpu"), fused_lm_head=True)


def tiny_transforming_teacher(family: str):
    """A tiny causal LM whose architecture transforms its logits after the head."""
    import transformers

    common = dict(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM(config)
    elif family == "cohere":
        config = transformers.CohereConfig(**common, logit_scale=0.25)
        model = transformers.CohereForCausalLM(config)
    else:
        config = transformers.GraniteConfig(**common, logits_scaling=4.0)
        model = transformers.GraniteForCausalLM(config)
    torch.manual_seed(0)
    for parameter in model.parameters():  # large logits, so that the cap and the scale matter
        torch.nn.init.normal_(parameter, std=1.0)
    return model.eval()


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_teacher_heads_that_transform_logits_reproduce_the_models_own_logits(family, tmp_path):
    """Soft-capping and scaling are applied to a teacher's fused logits, in process and when served."""
    from opd.models.loading import load_output_layer
    from opd.teachers.scoring import PromptScorer

    model = tiny_transforming_teacher(family)
    input_ids = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(1))
    batch = BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor([7, 7]))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    head = LocalTeacher(model).get_hidden_states(batch)
    assert head.transforms_logits
    torch.testing.assert_close(head.logits(), expected, rtol=1e-5, atol=1e-5)
    # The served path: the decoder's rows on the server, the layer read from disk here.
    model.save_pretrained(tmp_path)
    layer = load_output_layer(str(tmp_path), torch.float32, torch.device("cpu"))
    rows = PromptScorer(model, 48).hidden_rows(input_ids.tolist(), [0, 0])
    served = torch.stack([layer.over(torch.cat([row, torch.zeros(1, 16)])).logits() for row in rows])
    torch.testing.assert_close(served[:, :-1], expected[:, :-1], rtol=1e-5, atol=1e-5)
    # Without the transform the logits would differ: the check can fail.
    assert not torch.allclose(LMHeadInput(head.hidden_states, head.weight).logits(), expected, atol=1e-2)


def test_a_teacher_output_layer_under_home_is_read_from_a_tilde_path(tmp_path, monkeypatch):
    """``~`` is expanded as for the other local model paths, not taken for a hub repository id."""
    from opd.models.loading import load_output_layer

    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "models" / "teacher")
    monkeypatch.setenv("HOME", str(tmp_path))
    layer = load_output_layer("~/models/teacher", torch.float32, torch.device("cpu"))
    torch.testing.assert_close(layer.weight, model.lm_head.weight.detach(), rtol=0, atol=0)
    assert layer.bias is None and (layer.logit_multiplier, layer.logit_softcap) == (1.0, None)


def test_bfloat16_models_run_through_the_fused_path():
    """A bf16 student: logits and matmuls in bf16, divergences in fp32, weight gradient
    accumulated in fp32 and returned in bf16; close to the plain bf16 path."""
    hidden, weight, bias, teacher_hidden, teacher_weight, weights = random_case(torch.float32, seed=14)
    teacher_logits = (teacher_hidden @ teacher_weight.T).bfloat16()
    loss_fn = KLLossFn("mixed", 0.5)
    leaves = [t.bfloat16().requires_grad_(True) for t in (hidden, weight, bias)]
    expected = plain_loss(*leaves, loss_fn._divergence, (teacher_logits,), weights)
    expected_grads = gradients(expected, leaves)
    fused_leaves = [t.bfloat16().requires_grad_(True) for t in (hidden, weight, bias)]
    fused = chunked_lm_head_loss(LMHeadInput(*fused_leaves), loss_fn._divergence, (teacher_logits,), weights, 4,
                                 value_and_grad=loss_fn._divergence_with_grad)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, expected.float(), rtol=1e-2, atol=1e-3)
    for got, want, leaf in zip(gradients(fused, fused_leaves), expected_grads, fused_leaves):
        assert got.dtype == leaf.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=1e-2)


@pytest.mark.parametrize("block_rows", [None, 7])  # the whole vocabulary at once, or blocks of 7 rows
@pytest.mark.parametrize(("dtype", "unit"), [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
def test_a_16_bit_weight_gradient_runs_in_16_bits_and_is_summed_in_fp32(dtype, unit, block_rows, monkeypatch):
    """Each chunk's gᵀ·h is a 16-bit matmul (its result is a 16-bit number); the chunks' sum is fp32's and stays
    within the rounding the docstring derives: 2u·Σ|g·h| for the cast gradient and the chunk's product, and fp32's
    unit roundoff once per row summed inside a chunk and once per chunk summed after it."""
    if block_rows is not None:  # vocabulary rows per block of the temporary product: 96 = 13 blocks of 7 and 5
        monkeypatch.setattr(fused_lm_head, "_WEIGHT_GRADIENT_BLOCK_BYTES", block_rows * 24 * dtype.itemsize)
    generator = torch.Generator().manual_seed(5)
    chunks, rows, vocab, width = 4, 16, 96, 24
    # Gradients spanning magnitudes, with signs that cancel in the sums.
    grad_logits = torch.randn(chunks * rows, vocab, generator=generator) * torch.logspace(-3, 1, vocab)
    hidden = torch.randn(chunks * rows, width, generator=generator).to(dtype)
    grad_weight = torch.zeros(vocab, width)
    for chunk in range(chunks):
        part = slice(chunk * rows, (chunk + 1) * rows)
        add_weight_gradient(grad_weight, grad_logits[part], grad_logits[part].to(dtype), hidden[part])
        if chunk == 0:  # one chunk's product, held in fp32, is a 16-bit number: the matmul ran in 16 bits
            torch.testing.assert_close(grad_weight, grad_weight.to(dtype).float(), rtol=0, atol=0)
    exact = grad_logits.double().T @ hidden.double()
    magnitude = grad_logits.double().abs().T @ hidden.double().abs()
    bound = (2 * unit + (rows + chunks) * 2.0**-24) * magnitude
    error = (grad_weight.double() - exact).abs()
    assert (error <= bound).all(), float((error / bound).max())
    assert float(error.max()) > 0  # not the fp32 path by accident


def test_an_fp32_weight_gradient_stays_fp32():
    """Within fp32's rounding of the row sum, far below any 16-bit rounding."""
    generator = torch.Generator().manual_seed(6)
    rows = 16
    grad_logits, hidden = torch.randn(rows, 40, generator=generator), torch.randn(rows, 8, generator=generator)
    grad_weight = torch.zeros(40, 8)
    add_weight_gradient(grad_weight, grad_logits, grad_logits, hidden)
    magnitude = grad_logits.double().abs().T @ hidden.double().abs()
    error = (grad_weight.double() - grad_logits.double().T @ hidden.double()).abs()
    assert (error <= (rows + 1) * 2.0**-24 * magnitude).all()
