"""Reference values: every loss type's value, gradients and metrics on fixed inputs.

Pins the numbers that the loss objects produced before the architecture refactor, so
the refactor can show that it changed no behaviour. The loss objects are built directly
through their constructors (``KLLossFn``, ``JSDLossFn``, ``TopKKLLossFn``,
``SampledTokenLossFn``, ``FullVocabHybridLossFn``); their inputs are rebuilt here from
fixed ``torch.Generator`` seeds (:func:`build_inputs`), so ``reference_losses.json``
holds only outputs (plus the seed and shapes, for the record).

Each case in :data:`LOSS_CASES` is run on a micro-batch of B = 3 sequences of L = 7
tokens (row 0: prompt, 4 response tokens, padding; row 1: 6 response tokens; row 2:
all masked) with a 13-entry output layer, cut to the first 11 entries where the case
says ``vocab_size``, in float32 on CPU. The normalisers are those of a larger global
batch (``GLOBAL_EXTRA_TOKENS`` / ``GLOBAL_EXTRA_SEQS`` more than this micro-batch), so
the global normalisation is pinned too. Unfused cases take ``[B, L, V]`` logits and
record their gradient; fused cases (``fused_lm_head=True``) take
:class:`~opd.kernels.fused_lm_head.LMHeadInput` hidden states and head, and record
the gradients of the hidden states, head weight and head bias. The unfused logits are
exactly the fused head's logits, so both variants of a case compute the same loss.

Asserted: the loss and every gradient within ``RTOL`` relative and ``ATOL`` absolute
(:func:`test_loss_and_gradients_match_reference`), and the metrics dict the loss returns
with the same tolerances (:func:`test_loss_metrics_match_reference`); for a top-k case with
the rest class, plus what the rounding of the teacher's top-k log-probs moves each number
by (:data:`TOPK_LOGPROB_ROUNDING`, :func:`rest_mass_sensitivity`): its rest mass
``1 - sum(top-k probabilities)`` is where float32 rounding is amplified, and no recording
can pin it closer than that on other CPU kernels.

The values were produced from the baseline checkout (commit in the JSON) with::

    cd <checkout> && PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/reference/record_reference_values.py --part losses --repeat 2
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from opd.kernels.fused_lm_head import LMHeadInput
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.hybrid_loss import FullVocabHybridLossFn
from opd.losses.sampled_token import SampledTokenLossFn

REFERENCE_FILE = Path(__file__).resolve().parent / "reference_losses.json"

SEED = 20240611
B, L, V, D, D_TEACHER = 3, 7, 13, 8, 10
VOCAB_CUT = 11
"""The real vocabulary of the cases that set ``vocab_size`` (entries 11 and 12 are output-layer padding)."""
GLOBAL_EXTRA_TOKENS = 3
"""The global batch has this many more valid tokens than the micro-batch (other micro-batches)."""
GLOBAL_EXTRA_SEQS = 2
"""... and this many more sequences."""
TOPK = 4
FUSED_CHUNK_SIZE = 4
"""Positions per chunk of the fused cases: several chunks (and a partial last one) per call."""
EPS32 = torch.finfo(torch.float32).eps
"""2^-23 = 1.19e-7: float32's spacing at 1 (one rounding moves a number by at most half of it, relative)."""
RTOL, ATOL = 1e-5, 1e-6
"""What a well-conditioned case may differ by on other CPU kernels (AVX2, AVX-512, none: their exp, log and
sums round differently), :func:`assert_within_tolerance`. A number here is a sum over at most B * L = 21
positions of a V = 13-entry divergence, each entry rounded a few times: (V + B * L) * EPS32 = 4.0e-6 relative to
the size of the terms summed; RTOL allows 2.5 times that for the cancellation inside a divergence
(p * (log p - log q) changes sign). An entry of a gradient sums products whose size is its tensor's, not its own
(an entry of 6e-3 in a head gradient of 3.9 rounds like the 3.9), so RTOL applies to the entry plus its tensor's
largest entry; ATOL is the floor for a number near zero (a metric of 0)."""
TOPK_LOGPROB_ROUNDING = (VOCAB_CUT + TOPK) * EPS32
"""How far a float32 top-k log-prob of the teacher may be from the recording's: log_softmax over the
VOCAB_CUT = 11 entries rounds each log-prob by up to about one EPS32 per entry summed (its log-sum-exp), and the
rest mass 1 - sum(exp(top-k)) adds one rounding per top-k entry. That error is amplified where the rest mass is
small: its relative error is the log-probs' times S / (1 - S), S the top-k mass, which reaches 7,646 at one
position of these inputs (row 1, position 0, at temperature 1), enough to move a gradient entry by 1e-5."""


@dataclass(frozen=True)
class LossCase:
    """One loss configuration: the class, its constructor arguments and the inputs it takes.

    Attributes:
        loss_class: ``"distillation"``, ``"sampled_token"`` or ``"hybrid_full_vocab"``.
        kwargs: constructor keyword arguments (``fused_lm_head`` included where it applies).
        fused: the student's output is an ``LMHeadInput`` (hidden states and head).
        task_reward: put ``data["task_reward"]`` into the micro-batch.
    """

    loss_class: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    fused: bool = False
    task_reward: bool = False


def _distillation_cases() -> dict[str, LossCase]:
    base: dict[str, dict[str, Any]] = {
        "kl_forward": {"kl_type": "forward"},  # the only case with the full 13-entry vocabulary
        "kl_reverse": {"kl_type": "reverse", "vocab_size": VOCAB_CUT},
        "kl_mixed_0.3": {"kl_type": "mixed", "mixed_kl_weight": 0.3, "vocab_size": VOCAB_CUT},
        "kl_reverse_temperature_2": {"kl_type": "reverse", "temperature": 2.0, "vocab_size": VOCAB_CUT},
        "kl_forward_reduction_sum": {"kl_type": "forward", "kl_reduction": "sum", "vocab_size": VOCAB_CUT},
        "jsd_beta_0.3": {"divergence": "jsd", "jsd_beta": 0.3, "vocab_size": VOCAB_CUT},
        "topk_tail_mixed_0.3": {"teacher_signal": "topk", "teacher_topk": TOPK, "topk_tail": True,
                                "kl_type": "mixed", "mixed_kl_weight": 0.3, "vocab_size": VOCAB_CUT},
        "topk_renormalised_mixed_0.3": {"teacher_signal": "topk", "teacher_topk": TOPK, "topk_tail": False,
                                        "kl_type": "mixed", "mixed_kl_weight": 0.3, "vocab_size": VOCAB_CUT},
        "topk_tail_reverse_temperature_2": {"teacher_signal": "topk", "teacher_topk": TOPK, "topk_tail": True,
                                            "kl_type": "reverse", "temperature": 2.0, "vocab_size": VOCAB_CUT},
    }
    cases = {}
    for name, kwargs in base.items():
        cases[f"distillation/{name}/unfused"] = LossCase("distillation", {**kwargs, "fused_lm_head": False})
        cases[f"distillation/{name}/fused"] = LossCase(
            "distillation", {**kwargs, "fused_lm_head": True, "chunk_size": FUSED_CHUNK_SIZE}, fused=True)
    return cases


def _sampled_token_cases() -> dict[str, LossCase]:
    base: dict[str, tuple[dict[str, Any], bool]] = {
        "default": ({"vocab_size": VOCAB_CUT}, False),
        "discount_0.5": ({"discount": 0.5, "vocab_size": VOCAB_CUT}, False),
        "adv_tau_0.5_task_reward": ({"adv_tau": 0.5, "teacher_tau": 0.8, "student_tau": 1.2,
                                     "vocab_size": VOCAB_CUT}, True),
        "no_clip_reduction_sum": ({"clip_ratio": None, "kl_reduction": "sum", "vocab_size": VOCAB_CUT}, False),
    }
    cases = {}
    for name, (kwargs, reward) in base.items():
        cases[f"sampled_token/{name}/unfused"] = LossCase(
            "sampled_token", {**kwargs, "fused_lm_head": False}, task_reward=reward)
        cases[f"sampled_token/{name}/fused"] = LossCase(
            "sampled_token", {**kwargs, "fused_lm_head": True, "chunk_size": FUSED_CHUNK_SIZE}, fused=True,
            task_reward=reward)
    return cases


LOSS_CASES: dict[str, LossCase] = {
    **_distillation_cases(),
    **_sampled_token_cases(),
    "hybrid_full_vocab/default/unfused": LossCase("hybrid_full_vocab", {"vocab_size": VOCAB_CUT}),
    "hybrid_full_vocab/taus_adv_tau_0.5_task_reward/unfused": LossCase(
        "hybrid_full_vocab", {"teacher_tau": 0.7, "student_tau": 0.4, "adv_tau": 0.5, "vocab_size": VOCAB_CUT},
        task_reward=True),
    "hybrid_full_vocab/reduction_sum_full_vocabulary/unfused": LossCase(
        "hybrid_full_vocab", {"kl_reduction": "sum"}),
}
"""Every recorded case, by name: ``<loss class>/<configuration>/<fused or unfused>``."""


# --------------------------------------------------------------------------- inputs


def build_inputs() -> dict[str, torch.Tensor]:
    """The fixed float32 inputs every case draws from (the same tensors on every call).

    Returns:
        ``student_hidden [B, L, D]``, ``student_weight [V, D]``, ``student_bias [V]``, the
        teacher's ``teacher_hidden [B, L, D_TEACHER]`` / ``teacher_weight`` / ``teacher_bias``,
        both models' logits (the heads applied to the hidden states), ``input_ids``,
        ``token_mask``, ``generation_logprobs`` (the student's own log-probs of the tokens
        plus noise, so some importance ratios fall outside the clip range), the teacher's
        token log-probs ``teacher_token_logprobs`` (``[B, L]``, 0 at position 0) and
        ``task_reward [B]``.
    """
    generator = torch.Generator().manual_seed(SEED)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * scale

    inputs = {
        "student_hidden": randn(B, L, D),
        "student_weight": randn(V, D, scale=0.8),
        "student_bias": randn(V, scale=0.5),
        "teacher_hidden": randn(B, L, D_TEACHER, scale=1.5),
        "teacher_weight": randn(V, D_TEACHER),
        "teacher_bias": randn(V, scale=0.5),
    }
    input_ids = torch.randint(0, VOCAB_CUT, (B, L), generator=generator)
    token_mask = torch.zeros(B, L, dtype=torch.long)
    token_mask[0, 2:6] = 1  # prompt (2 tokens), 4 response tokens, 1 padding
    token_mask[1, 1:7] = 1  # 1 prompt token, 6 response tokens
    # Row 2: all masked (a response that carries no loss).
    with torch.no_grad():
        student_logits = torch.nn.functional.linear(
            inputs["student_hidden"], inputs["student_weight"], inputs["student_bias"])
        teacher_logits = torch.nn.functional.linear(
            inputs["teacher_hidden"], inputs["teacher_weight"], inputs["teacher_bias"])
    next_ids = input_ids[:, 1:, None]
    own = torch.log_softmax(student_logits[:, :-1, :VOCAB_CUT], -1).gather(-1, next_ids).squeeze(-1)
    noise = randn(B, L - 1, scale=0.3)
    teacher_own = torch.log_softmax(teacher_logits[:, :-1, :VOCAB_CUT], -1).gather(-1, next_ids).squeeze(-1)
    zeros = torch.zeros(B, 1, dtype=torch.float32)
    inputs.update(
        student_logits=student_logits,
        teacher_logits=teacher_logits,
        input_ids=input_ids,
        token_mask=token_mask,
        generation_logprobs=torch.cat([zeros, own + noise], dim=1),
        teacher_token_logprobs=torch.cat([zeros, teacher_own], dim=1),
        task_reward=torch.tensor([1.0, 0.0, 1.0], dtype=torch.float32),
    )
    return inputs


def make_loss_fn(case: LossCase) -> Any:
    """The loss object of ``case``, built through its class's constructor.

    A recorded ``distillation`` case names its class as the recording's single class did:
    ``teacher_signal: topk`` (with ``teacher_topk`` and ``topk_tail``) is :class:`TopKKLLossFn`,
    ``divergence: jsd`` (with ``jsd_beta``) is :class:`JSDLossFn`, the rest :class:`KLLossFn`.
    """
    kwargs = dict(case.kwargs)
    if case.loss_class == "sampled_token":
        return SampledTokenLossFn(**kwargs)
    if case.loss_class == "hybrid_full_vocab":
        return FullVocabHybridLossFn(**kwargs)
    if kwargs.pop("teacher_signal", "full_vocab") == "topk":
        return TopKKLLossFn(k=kwargs.pop("teacher_topk"), tail=kwargs.pop("topk_tail", True), **kwargs)
    if kwargs.pop("divergence", "kl") == "jsd":
        return JSDLossFn(beta=kwargs.pop("jsd_beta"), **kwargs)
    return KLLossFn(**kwargs)


def _teacher_topk(logits: torch.Tensor, k: int, temperature: float, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k log-probs and ids at ``temperature`` over its real vocabulary."""
    cut = logits if vocab_size is None else logits[..., :vocab_size]
    log_p = torch.log_softmax(cut / temperature, dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    return values, ids


def compute_case(case: LossCase, dtype: torch.dtype = torch.float32,
                 teacher_logprob_shift: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Runs one case: the loss, the gradients of the student's inputs, the metrics.

    Args:
        case: the loss configuration.
        dtype: the float inputs' dtype (the recording's float32; float64 for
            :func:`rest_mass_sensitivity`).
        teacher_logprob_shift: added to every top-k log-prob of the teacher (top-k cases).

    Returns:
        ``(loss, gradients, metrics)``; the gradients are keyed ``student_logits``
        (unfused) or ``hidden_states`` / ``weight`` / ``bias`` (fused).
    """
    inputs = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
              for name, tensor in build_inputs().items()}
    loss_fn = make_loss_fn(case)
    data: dict[str, Any] = {"input_ids": inputs["input_ids"], "token_mask": inputs["token_mask"]}
    if case.loss_class == "sampled_token":
        data["generation_logprobs"] = inputs["generation_logprobs"]
    if case.task_reward:
        data["task_reward"] = inputs["task_reward"]

    if case.fused:
        leaves = {
            "hidden_states": inputs["student_hidden"].clone().requires_grad_(True),
            "weight": inputs["student_weight"].clone().requires_grad_(True),
            "bias": inputs["student_bias"].clone().requires_grad_(True),
        }
        student_output: Any = LMHeadInput(leaves["hidden_states"], leaves["weight"], leaves["bias"])
    else:
        leaves = {"student_logits": inputs["student_logits"].clone().requires_grad_(True)}
        student_output = leaves["student_logits"]

    if case.loss_class == "sampled_token":
        teacher_output: Any = inputs["teacher_token_logprobs"]
    elif case.loss_class == "distillation" and case.kwargs.get("teacher_signal") == "topk":
        values, ids = _teacher_topk(inputs["teacher_logits"], case.kwargs["teacher_topk"],
                                    case.kwargs.get("temperature", 1.0), case.kwargs.get("vocab_size"))
        teacher_output = (values + teacher_logprob_shift, ids)
    elif case.fused:
        teacher_output = LMHeadInput(inputs["teacher_hidden"], inputs["teacher_weight"], inputs["teacher_bias"])
    else:
        teacher_output = inputs["teacher_logits"]

    local_tokens = int(inputs["token_mask"][:, 1:].sum())
    loss, metrics = loss_fn(student_output, data, local_tokens + GLOBAL_EXTRA_TOKENS, B + GLOBAL_EXTRA_SEQS,
                            teacher_output=teacher_output)
    loss.backward()
    gradients = {name: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for name, leaf in leaves.items()}
    return loss.detach(), gradients, dict(metrics)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return json.loads(REFERENCE_FILE.read_text(encoding="utf-8"))


def test_reference_file_covers_every_case(reference):
    """The recording was made from exactly these cases and inputs."""
    assert set(reference["cases"]) == set(LOSS_CASES)
    assert reference["inputs"] == input_description()
    for name, case in LOSS_CASES.items():
        recorded = reference["cases"][name]
        assert (recorded["loss_class"], recorded["constructor_kwargs"], recorded["fused"], recorded["task_reward"]) == (
            case.loss_class, case.kwargs, case.fused, case.task_reward), name


def rest_mass_sensitivity(case: LossCase) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    """How much the teacher's top-k log-probs being off by :data:`TOPK_LOGPROB_ROUNDING` moves each output.

    Zero except for a top-k case with the rest class (renormalised top-k cancels a shift of
    every log-prob). Computed in float64, to first order: every top-k log-prob shifted the
    same way moves the rest mass most, by its condition number ``S / (1 - S)`` times the shift.

    Returns:
        ``(loss, gradients, metrics)`` as :func:`compute_case`, each entry the absolute change.
    """
    if not (case.kwargs.get("teacher_signal") == "topk" and case.kwargs.get("topk_tail")):
        return 0.0, {}, {}
    loss, gradients, metrics = compute_case(case, torch.float64)
    shifted_loss, shifted_gradients, shifted_metrics = compute_case(case, torch.float64, TOPK_LOGPROB_ROUNDING)
    return (abs(float(shifted_loss - loss)),
            {key: (shifted_gradients[key] - gradient).abs().float() for key, gradient in gradients.items()},
            {key: abs(float(shifted_metrics[key]) - float(value)) for key, value in metrics.items()})


def assert_within_tolerance(actual: torch.Tensor, expected: torch.Tensor, sensitivity: torch.Tensor | float,
                            label: str) -> None:
    """Every entry within ``ATOL + RTOL * (|expected| + max |expected|)`` plus its rest-mass sensitivity."""
    allowed = ATOL + RTOL * (expected.abs() + expected.abs().max()) + sensitivity
    excess = ((actual - expected).abs() / allowed).flatten()
    worst = int(excess.argmax())
    assert float(excess[worst]) <= 1.0, (
        f"{label}: entry {worst} is {float(actual.flatten()[worst])!r}, recorded {float(expected.flatten()[worst])!r}: "
        f"{float(excess[worst]):.2f} times its tolerance {float(allowed.flatten()[worst]):.2e}"
    )


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_loss_and_gradients_match_reference(name, reference):
    expected = reference["cases"][name]
    loss, gradients, _ = compute_case(LOSS_CASES[name])
    loss_sensitivity, gradient_sensitivity, _ = rest_mass_sensitivity(LOSS_CASES[name])
    assert_within_tolerance(loss, torch.tensor(expected["loss"], dtype=loss.dtype), loss_sensitivity, f"{name} loss")
    assert set(gradients) == set(expected["gradients"])
    for key, gradient in gradients.items():
        assert_within_tolerance(gradient, torch.tensor(expected["gradients"][key], dtype=gradient.dtype),
                                gradient_sensitivity.get(key, 0.0), f"{name} d/d{key}")


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_loss_metrics_match_reference(name, reference):
    expected = reference["cases"][name]["metrics"]
    _, _, metrics = compute_case(LOSS_CASES[name])
    _, _, sensitivity = rest_mass_sensitivity(LOSS_CASES[name])
    assert set(metrics) == set(expected)
    for key, value in metrics.items():
        assert value == pytest.approx(expected[key], rel=RTOL, abs=ATOL + sensitivity.get(key, 0.0)), f"{name}: {key}"


def input_description() -> dict[str, Any]:
    """The seed and shapes of :func:`build_inputs`, stored beside the outputs for the record."""
    return {"seed": SEED, "B": B, "L": L, "V": V, "D": D, "D_teacher": D_TEACHER, "vocab_cut": VOCAB_CUT,
            "topk": TOPK, "fused_chunk_size": FUSED_CHUNK_SIZE, "global_extra_tokens": GLOBAL_EXTRA_TOKENS,
            "global_extra_seqs": GLOBAL_EXTRA_SEQS, "dtype": "float32",
            "token_mask": build_inputs()["token_mask"].tolist()}
