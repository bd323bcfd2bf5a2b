"""Every common decoder family through opd's fused paths, against the plain transformers forward.

For a tiny, randomly initialised float64 model of each family in :data:`FAMILIES` (built
from its transformers config class: nothing is downloaded), with what makes the family
differ from the Qwen2 models the rest of the suite uses (tied or untied embeddings,
sliding windows shorter than the sequences, Gemma's scaled embeddings, attention and
final-logit soft-capping, Gemma 3's mix of sliding and global layers, Phi-3's fused
projections):

1. the student's fused loss (its final hidden states and output layer through
   :func:`~opd.policy.hf_policy.student_output`, the in-process teacher's hidden
   states and output layer) gives the loss value and the gradient of every parameter that
   the plain path gives (``model(input_ids, attention_mask).logits``, the teacher's
   logits, the same loss unfused), on right-padded rows of unequal length;
2. the in-process teacher's logits, however it makes them (the model's forward, its
   decoder and output layer, one pass per shared prompt, the server's scorer), are the
   model's logits;
3. opd's decode loop decodes greedily the tokens that a plain step-by-step arg-max over
   the whole sequence's forward (no KV cache, one row at a time: no padding) decodes,
   on prompts of different lengths whose rows stop at different steps, with the
   log-probs of that forward. The eager decode step runs for every family; the compiled
   one (``generation.compile_decode``) compiles for half a minute per model, so it runs in
   the ``slow`` tier, on Gemma 3 as released (its decoder compiled and fed embeddings).

Tolerances. Both sides of each comparison evaluate the same float64 expressions; they
differ only in the order of floating-point reductions (a matmul over the selected rows
instead of all of them, chunked sums, a KV cache instead of the whole sequence, another
batch shape). Each reduction here has at most n = 512 terms (the vocabulary, the width,
the positions), whose rounding is bounded by γ_n ≈ n·u ≈ 6e-14 of the sum of the terms'
magnitudes (u = 2⁻⁵³); the loss, its gradients and the logits compose a few dozen such
steps (three layers forward and back) with well-conditioned tiny models: a bound of the
order of 1e-12. Comparing normwise (the difference against the largest entry of the
reference tensor, so that entries that cancel to nearly zero are not asked for relative
accuracy), :data:`FLOAT64_TOLERANCE` = 1e-10 stays two orders above that bound whatever
the SIMD width (AVX2, AVX-512) and the reduction order it picks, while every defect these
tests exist for (a missed soft cap, an unscaled embedding, a sliding window applied to
the wrong positions) moves the values by 1e-3 or more. The decode loop's and the teacher's log-probs are float32 by contract
(:func:`~opd.rollout.sampling.next_tokens` and
:func:`~opd.models.lm_head.map_log_softmax_chunks` cast the logits), so they are compared to
float32 rounding of values of magnitude ≤ 20 (:data:`FLOAT32_LOGPROB_TOLERANCE`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import attention_mask_from_lengths, pack_sequences, shift_token_mask
from opd.losses.distillation_losses import KLLossFn, TopKKLLossFn
from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import LMHeadInput, output_layer_of
from opd.policy.hf_policy import student_output
from opd.rollout.hf_generation import HFGeneration
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.scoring import PromptScorer
from opd.utils.compile_cache import compiler_toolchain_problem

VOCAB = 320
PAD = 0
SLIDING_WINDOW = 5
"""Shorter than the training rows and the decoded sequences below, longer than any training row's padding.

Longer than the padding because transformers' eager attention (Gemma 2's only kernel)
takes its softmax in float32: a float64 model's mask, −1.8e308, becomes −inf there, and
a query whose whole window is padding gets NaN, which spreads to the row's real positions
through the next layer's ``0 · NaN``. Float32 and bfloat16 models keep a finite mask
(checked in :func:`test_each_family_has_what_the_tests_are_about`), and opd never loads a model
in float64: this is an artefact of a float64 reference, not a case opd meets.
A left-padded prompt's first padding query sees nothing but padding whatever the window,
so Gemma 2 decodes in float32 (:attr:`Family.decode_dtype`)."""

FLOAT64_TOLERANCE = 1e-10
"""Normwise, for float64 values computed in two reduction orders (see the module docstring)."""
FLOAT32_LOGPROB_TOLERANCE = 2e-5
"""Absolute, for float32 log-probs of float64 logits of magnitude ≤ 20: 20 · 2⁻²⁴ per rounding, a few roundings."""
FLOAT32_FORWARD_TOLERANCE = 2e-4
"""Absolute, for log-probs from a float32 forward: γ_n · 2⁻²⁴ with n = 512 is 3e-5 of magnitudes
up to a few units, for the logit and for the log-sum-exp."""
DECODE_MARGINS = {torch.float64: 1e-4, torch.float32: 1e-3}
"""The gap between the two best logits that float32 rounding (of the logits; of the whole
forward) cannot close: where the reference's gaps are wider, any other arg-max is a defect."""


@dataclass(frozen=True)
class Family:
    """A decoder family: its transformers classes and the config values that make it itself.

    Attributes:
        name: the test id.
        config_class: the transformers config class's name.
        model_class: the causal LM class's name.
        options: config values on top of :data:`COMMON`.
        scaled_embeddings: the family multiplies its input embeddings by √hidden (Gemma).
        attention: transformers' attention kernel: the family's default (Gemma 2 has no
            SDPA kernel: SDPA cannot soft-cap the attention logits).
        decode_dtype: the dtype greedy decoding runs in (the reference stays float64).
    """

    name: str
    config_class: str
    model_class: str
    options: dict[str, Any] = field(default_factory=dict)
    scaled_embeddings: bool = False
    attention: str = "sdpa"
    decode_dtype: torch.dtype = torch.float64


COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Large initial weights: peaked distributions, logits of a few units (so that the soft
    # caps below bend them) and clear arg-max margins for greedy decoding.
    initializer_range=0.2,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)
# transformers' Gemma 3 keeps attn_logit_softcapping in its config but applies it nowhere
# (its queries and keys are normalised instead); Gemma 2 applies it.
GEMMA: dict[str, Any] = dict(
    head_dim=8,
    query_pre_attn_scalar=8,
    sliding_window=SLIDING_WINDOW,
    final_logit_softcapping=2.0,
    attn_logit_softcapping=1.0,
)
FAMILIES = [
    Family("llama-tied", "LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    Family("llama-untied", "LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    Family("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": SLIDING_WINDOW}),
    Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        GEMMA,
        scaled_embeddings=True,
        attention="eager",
        decode_dtype=torch.float32,
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**GEMMA, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        scaled_embeddings=True,
    ),
    # Gemma 3 as released: no soft caps, so its head is a plain linear layer (the fused
    # paths' other branch: the compiled decode step runs the decoder on embeddings).
    Family(
        "gemma3-uncapped",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **GEMMA,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
        scaled_embeddings=True,
    ),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM"),
]


def build(family: Family, seed: int, dtype: torch.dtype = torch.float64, **changes: Any) -> Any:
    """The family's tiny causal LM (float64 unless said), in eval mode, seeded; ``changes`` edit its config."""
    options = {**COMMON, **family.options, **changes}
    config = getattr(transformers, family.config_class)(**options, attn_implementation=family.attention)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(config)
    return model.to(dtype).eval()


@pytest.fixture(scope="module", params=FAMILIES, ids=[family.name for family in FAMILIES])
def family_models(request: pytest.FixtureRequest) -> tuple[Family, Any, Any]:
    """``(family, student, teacher)``: two independently initialised models of one family."""
    family = request.param
    return family, build(family, seed=1), build(family, seed=2)


def training_batch() -> BatchedDataDict:
    """Right-padded rows of unequal length; rows 0 and 2 share their prompt (one teacher pass over it)."""
    generator = torch.Generator().manual_seed(3)
    lengths, prompt_lengths = [12, 8, 11, 9], [4, 3, 4, 2]
    rows = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]
    rows[2][:4] = rows[0][:4]
    return pack_sequences(rows, prompt_lengths, PAD, True)


def attention_mask(batch: BatchedDataDict) -> torch.Tensor:
    return attention_mask_from_lengths(batch["input_lengths"], batch["input_ids"].shape[1])


def plain_logits(model: Any, batch: BatchedDataDict) -> torch.Tensor:
    """The reference: transformers' own forward over the padded batch."""
    return model(input_ids=batch["input_ids"], attention_mask=attention_mask(batch)).logits


def valid_positions(batch: BatchedDataDict) -> torch.Tensor:
    """``[B, L]`` True at each row's real tokens (padding positions' outputs are read by nothing)."""
    return attention_mask(batch).bool()


def assert_equal_to_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``max |got − want| ≤ FLOAT64_TOLERANCE · max |want|`` (normwise: see the module docstring)."""
    assert got.shape == want.shape, what
    scale = max(float(want.abs().max()), 1e-300) if want.numel() else 1.0
    error = float((got - want).abs().max()) if want.numel() else 0.0
    assert error <= FLOAT64_TOLERANCE * scale, f"{what}: max error {error:.3e} against max |value| {scale:.3e}"


# ------------------------------------------------------------------ the model of each family


def test_each_family_has_what_the_tests_are_about(family_models):
    """The configs exercise the family's particularities (else the comparisons below prove less)."""
    family, student, _ = family_models
    batch = training_batch()
    config = student.config
    assert max(batch["input_lengths"].tolist()) > SLIDING_WINDOW
    tied = student.get_output_embeddings().weight is student.get_input_embeddings().weight
    assert tied == bool(config.tie_word_embeddings), "tying follows the config"
    if family.name.startswith("llama"):
        assert tied == (family.name == "llama-tied")
    layer_types = getattr(config, "layer_types", None) or []
    if family.name in ("mistral", "gemma2", "gemma3"):
        assert config.sliding_window == SLIDING_WINDOW
    if family.name == "gemma3":
        assert set(layer_types) == {"sliding_attention", "full_attention"}
    if family.scaled_embeddings:
        embedded = student.get_input_embeddings()(batch["input_ids"][:1])
        raw = torch.nn.functional.embedding(batch["input_ids"][:1], student.get_input_embeddings().weight)
        torch.testing.assert_close(embedded, raw * config.hidden_size**0.5)
    if getattr(config, "final_logit_softcapping", None) is not None:
        with torch.no_grad():
            logits = plain_logits(student, batch)
            # The final soft cap bends the logits: without it they would be much larger.
            raw_logits = torch.nn.functional.linear(
                student.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state,
                student.get_output_embeddings().weight,
            )
            assert float(logits.abs().max()) < config.final_logit_softcapping < float(raw_logits.abs().max())
            if family.attention == "eager":
                # So does the attention soft cap (Gemma 2's eager kernel applies it).
                uncapped = plain_logits(build(family, seed=1, attn_logit_softcapping=None), batch)
                assert not torch.allclose(uncapped, logits, atol=1e-3)
                # A window of padding alone is harmless where models train: float32 and bfloat16 keep the mask finite.
                padded = pack_sequences([[5] * 2 * SLIDING_WINDOW, [5] * 2], [1, 1], PAD, True)
                for dtype in (torch.float32, torch.bfloat16):
                    assert torch.isfinite(plain_logits(build(family, seed=1, dtype=dtype), padded)).all()


# ----------------------------------------------------------- 1. the fused loss and its gradients


LOSSES = {
    # The closed-form gradient (value_and_grad) with the teacher's hidden states and head.
    "kl-mixed": (KLLossFn, dict(kl_type="mixed", mixed_kl_weight=0.3, temperature=1.3)),
    # Autograd through the divergence (no closed form), with the teacher's top-k.
    "topk": (TopKKLLossFn, dict(k=5, kl_type="mixed", temperature=1.3)),
}


def reference_topk(teacher: Any, batch: BatchedDataDict, k: int, temperature: float):
    """The teacher's top-k log-probs from its plain logits, in float64."""
    with torch.no_grad():
        log_p = torch.log_softmax(plain_logits(teacher, batch) / temperature, dim=-1)
    return tuple(log_p.topk(k, dim=-1))


def parameter_gradients(model: Any, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names, parameters = zip(*model.named_parameters())  # a tied embedding is listed once
    return dict(zip(names, torch.autograd.grad(loss, parameters)))


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_fused_loss_and_gradients_equal_the_plain_forward(family_models, loss_name):
    _, student, teacher_model = family_models
    batch = training_batch()
    tokens = int(shift_token_mask(batch["token_mask"]).sum())
    loss_class, options = LOSSES[loss_name]
    results = []
    for fused in (False, True):
        loss_fn = loss_class(**options, fused_lm_head=fused, chunk_size=7)
        if loss_name == "topk":
            teacher_output = reference_topk(teacher_model, batch, options["k"], options["temperature"])
        elif fused:  # the normal fused path: the in-process teacher's hidden states and output layer
            teacher_output = LocalTeacher(teacher_model).score(batch, loss_fn.teacher_request)
            assert isinstance(teacher_output, LMHeadInput)
        else:
            with torch.no_grad():
                teacher_output = plain_logits(teacher_model, batch)
        output = student_output(student, batch, torch.device("cpu"), fused) if fused else plain_logits(student, batch)
        assert isinstance(output, LMHeadInput) == fused
        loss, metrics = loss_fn(output, batch, tokens, batch.size, teacher_output=teacher_output)
        results.append((loss.detach(), metrics, parameter_gradients(student, loss)))
    (plain_loss, plain_metrics, plain_grads), (fused_loss, fused_metrics, fused_grads) = results
    assert_equal_to_rounding(fused_loss, plain_loss, "loss")
    assert float(plain_loss) > 1e-3
    for key, value in plain_metrics.items():
        assert fused_metrics[key] == pytest.approx(value, rel=FLOAT64_TOLERANCE, abs=FLOAT64_TOLERANCE), key
    assert plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        assert float(grad.abs().max()) > 0, f"{name} gets no gradient: the comparison would prove nothing"
        assert_equal_to_rounding(fused_grads[name], grad, name)


# ------------------------------------------------------------------------ 2. the teacher's logits


def test_the_in_process_teacher_scores_the_models_logits(family_models):
    family, _, teacher_model = family_models
    batch = training_batch()
    valid = valid_positions(batch)
    with torch.no_grad():
        expected = plain_logits(teacher_model, batch)
    for share_prompt in (False, True):
        teacher = LocalTeacher(teacher_model, share_prompt_forward=share_prompt)
        assert_equal_to_rounding(teacher.get_logits(batch)[valid], expected[valid], f"logits (shared: {share_prompt})")
        head = teacher.get_hidden_states(batch)
        assert_equal_to_rounding(head.logits()[valid], expected[valid], f"hidden states (shared: {share_prompt})")
        token_logprobs = teacher.get_token_logprobs(batch)
        reference = torch.log_softmax(expected[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        torch.testing.assert_close(
            token_logprobs[:, 1:][valid[:, 1:]].double(),
            reference[valid[:, 1:]],
            rtol=0,
            atol=FLOAT32_LOGPROB_TOLERANCE,
        )
    # The serving path: the scorer's padded decoder pass and its output layer.
    scorer = PromptScorer(teacher_model, VOCAB)
    sequences = [row[:length].tolist() for row, length in zip(batch["input_ids"], batch["input_lengths"])]
    rows = scorer.hidden_rows(sequences, [0] * len(sequences))
    for index, (hidden, sequence) in enumerate(zip(rows, sequences)):
        served = scorer.layer.over(hidden, VOCAB).logits()
        assert_equal_to_rounding(served, expected[index, : len(sequence) - 1], f"served row {index}")
    assert output_layer_of(teacher_model).logit_softcap == family.options.get("final_logit_softcapping")


# ---------------------------------------------------------------------------- 3. greedy decoding


BUDGET = 9
PROMPT_LENGTHS = [6, 10, 7, 9]


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def plain_greedy(model: Any, prompt: list[int], stop: int | None) -> tuple[list[int], list[float], float]:
    """Arg-max decoding with the whole sequence's forward at every step (no cache, no padding).

    Returns:
        ``(tokens, their float64 log-probs, the smallest gap between the two best logits)``.
    """
    sequence, tokens, logprobs, margin = list(prompt), [], [], float("inf")
    with torch.no_grad():
        for _ in range(BUDGET):
            logits = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            assert float(logits.abs().max()) <= 20, "the float32 log-prob tolerances assume logits within ±20"
            top = logits.topk(2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            sequence.append(token)
            if token == stop:
                break
    return tokens, logprobs, margin


def staggered_stop(responses: list[list[int]]) -> int:
    """A token that, declared a stop token, ends the rows at as many different steps as possible."""

    def lengths(token: int) -> int:
        return len({response.index(token) + 1 if token in response else BUDGET for response in responses})

    return max(sorted({token for response in responses for token in response}), key=lengths)


def test_greedy_decoding_equals_plain_argmax_over_the_whole_sequence(family_models):
    """opd's KV-cache loop over left-padded prompts, rows leaving the batch as they stop."""
    family, _, model = family_models
    check_greedy_decoding(family, model, compile_decode=False)


@pytest.mark.slow  # compiles a decoder from nothing: half a minute on 2 cores
@pytest.mark.skipif(compiler_toolchain_problem("cpu") is not None, reason="torch.compile needs a C++ compiler on CPU")
def test_compiled_greedy_decoding_equals_plain_argmax_for_gemma3():
    """The compiled decode step's own forward (embeddings, then the compiled decoder on them, then
    the head) on Gemma 3: its embeddings are scaled, its layers mix sliding and global attention.

    Every row runs to the budget (no stop token): one batch shape, compiled once (27 s on one
    core from an empty inductor cache, against 49 s for rows leaving the batch one by one, each
    new shape compiled again). Rows leaving a compiled batch: tests/unit/models/test_decode_loop.py.
    """
    family = next(family for family in FAMILIES if family.name == "gemma3-uncapped")
    check_greedy_decoding(family, build(family, seed=2), compile_decode=True, staggered=False)


def check_greedy_decoding(family: Family, model: Any, compile_decode: bool, staggered: bool = True) -> None:
    """opd's greedy decode of :func:`prompts` with ``model`` equals :func:`plain_greedy`'s.

    ``staggered``: a stop token ends the rows at different steps (the batch shrinks as they
    stop); else no stop token, and every row runs to the budget.
    """
    ids = prompts()
    stop = staggered_stop([plain_greedy(model, prompt, None)[0] for prompt in ids]) if staggered else None
    references = [plain_greedy(model, prompt, stop) for prompt in ids]
    # Well posed: rounding to the decode's precision cannot swap the two best logits.
    assert min(margin for _, _, margin in references) > DECODE_MARGINS[family.decode_dtype]
    assert (len({len(tokens) for tokens, _, _ in references}) > 1) == staggered, "rows should stop at different steps"
    assert max(len(prompt) + len(tokens) for prompt, (tokens, _, _) in zip(ids, references)) > SLIDING_WINDOW
    decoder = model if family.decode_dtype == torch.float64 else build(family, seed=2, dtype=family.decode_dtype)
    engine = HFGeneration(decoder, SimpleNamespace(pad_token_id=PAD), "opd", compile_decode,
                          stop_ids=(stop,) if stop is not None else ())
    if compile_decode:  # the branch that runs the decoder on embeddings: a plain head
        assert engine.step_forward is not None and not output_layer_of(decoder).transforms_logits
    batch = engine.generate(ids, GenerateStrategyConfig(decoding_method="greedy", max_length=BUDGET))
    tolerance = FLOAT32_LOGPROB_TOLERANCE if family.decode_dtype == torch.float64 else FLOAT32_FORWARD_TOLERANCE
    for row, (prompt, (tokens, logprobs, _)) in enumerate(zip(ids, references)):
        length = int(batch["input_lengths"][row])
        assert batch["input_ids"][row, len(prompt) : length].tolist() == tokens, f"row {row}"
        torch.testing.assert_close(
            batch["generation_logprobs"][row, len(prompt) : length].double(),
            torch.tensor(logprobs, dtype=torch.float64),
            rtol=0,
            atol=tolerance,
            msg=f"row {row}",
        )
