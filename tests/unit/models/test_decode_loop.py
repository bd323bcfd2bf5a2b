"""opd's decode loop and its sampler, against transformers and float64 references.

* the warpers equal transformers' ``TemperatureLogitsWarper`` / ``TopKLogitsWarper`` /
  ``TopPLogitsWarper`` on random and extreme logits;
* the two-level inverse-CDF draw returns exactly the index a one-level float64 CDF
  lookup returns, never draws a zero-probability entry, and its frequencies pass a
  chi-square test;
* greedy decoding equals ``model.generate`` token for token, also when rows end at
  different steps, and finished rows stop being fed to the model.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.rollout.decode_loop import decode
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.sampling import next_tokens, sample_from_probs, warp_logits
from opd.utils.compile_cache import compiler_toolchain_problem, resolve_compile_kernels
from opd.utils.errors import ConfigError


def hf_warped(logits: torch.Tensor, strategy: GenerateStrategyConfig) -> torch.Tensor:
    """What ``generate`` samples from: its warpers, in its order."""
    scores = TemperatureLogitsWarper(strategy.temperature)(None, logits.clone())
    if strategy.decoding_method == "top_k":
        scores = TopKLogitsWarper(strategy.top_k)(None, scores)
    elif strategy.top_p < 1.0:
        scores = TopPLogitsWarper(strategy.top_p)(None, scores)
    return scores


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


# ------------------------------------------------------------------------------ warpers


@pytest.mark.parametrize(
    "strategy",
    [
        GenerateStrategyConfig(decoding_method="top_p", top_p=1.0, temperature=0.7),
        GenerateStrategyConfig(decoding_method="top_p", top_p=0.9, temperature=1.3),
        GenerateStrategyConfig(decoding_method="top_p", top_p=0.3, temperature=0.5),
        GenerateStrategyConfig(decoding_method="top_p", top_p=1e-6, temperature=1.0),
        GenerateStrategyConfig(decoding_method="top_k", top_k=1, temperature=1.0),
        GenerateStrategyConfig(decoding_method="top_k", top_k=7, temperature=0.7),
        GenerateStrategyConfig(decoding_method="top_k", top_k=500, temperature=2.0),
    ],
    ids=["p=1", "p=0.9", "p=0.3", "p=1e-6", "k=1", "k=7", "k>=V"],
)
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["plain", "extreme"])
def test_warpers_equal_transformers(strategy, scale):
    logits = random_logits(6, 300, seed=1, scale=scale)
    logits[0, :50] = -math.inf  # an already-masked stretch must stay masked
    ours = warp_logits(logits, strategy)
    theirs = hf_warped(logits, strategy)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=0, atol=1e-6)


def test_top_k_keeps_every_entry_tied_at_the_threshold():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    warped = warp_logits(logits, GenerateStrategyConfig(decoding_method="top_k", top_k=2, temperature=1.0))
    assert torch.isfinite(warped).tolist() == [[True, False, True, True, False]]


# ------------------------------------------------------------------------------ the draw


def float64_reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One-level float64 inverse CDF: the first index whose cumulative mass exceeds u · total."""
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)


@pytest.mark.parametrize("block_size", [1, 3, 16, 1024, 5000])
def test_draw_equals_the_float64_inverse_cdf(block_size):
    probs = torch.softmax(random_logits(4, 1000, seed=2), dim=-1)
    probs[:, ::5] = 0.0  # masked entries scattered through every block
    grid = torch.linspace(0.0, 1.0 - 1e-9, 501, dtype=torch.float64)
    for u in grid:
        uniforms = torch.full((4,), float(u), dtype=torch.float64)
        drawn = sample_from_probs(probs, uniforms, block_size=block_size)
        assert torch.equal(drawn, float64_reference(probs, uniforms)), float(u)
        assert bool((probs.gather(-1, drawn.unsqueeze(-1)) > 0).all())


@pytest.mark.parametrize("block_size", [1, 4, 1024])
def test_draw_never_returns_a_zero_probability_entry_at_the_ends(block_size):
    probs = torch.zeros(3, 37)
    probs[0, 10:12] = torch.tensor([0.25, 0.75])  # zeros before and after
    probs[1, 36] = 2.0  # only the last entry, unnormalised
    probs[2, 0] = 1e-30  # only the first entry, tiny
    for u in (0.0, 0.5, 1.0 - 2**-53, 1.0):  # 1.0 itself: rounding at the top must not escape
        drawn = sample_from_probs(probs, torch.full((3,), u, dtype=torch.float64), block_size=block_size)
        assert bool((probs.gather(-1, drawn.unsqueeze(-1)) > 0).all()), (u, drawn.tolist())


def test_draw_frequencies_match_the_probabilities():
    torch.manual_seed(0)
    probs = torch.softmax(random_logits(1, 40, seed=3, scale=1.5), dim=-1)
    probs[0, 7] = 0.0
    samples = 200_000
    drawn = sample_from_probs(probs.expand(samples, -1).contiguous(), block_size=6)
    counts = torch.bincount(drawn, minlength=40).double()
    expected = probs[0].double() / probs.sum() * samples
    assert counts[7] == 0
    nonzero = expected > 0
    chi_square = float(((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum())
    # 38 degrees of freedom: P(chi² > 90) ≈ 5e-6 for a correct sampler; a one-entry
    # shift of the CDF or an off-by-one block gives chi² in the thousands.
    assert chi_square < 90.0, chi_square


def test_next_token_logprobs_are_the_warped_log_softmax():
    logits = random_logits(5, 200, seed=4)
    for strategy in (
        GenerateStrategyConfig(decoding_method="greedy"),
        GenerateStrategyConfig(decoding_method="top_k", top_k=9, temperature=0.6),
        GenerateStrategyConfig(decoding_method="top_p", top_p=0.8, temperature=1.4),
    ):
        torch.manual_seed(1)
        chosen, logprobs = next_tokens(logits, strategy, return_logprobs=True)
        reference = logits.double() if strategy.decoding_method == "greedy" else hf_warped(logits, strategy).double()
        expected = torch.log_softmax(reference, dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        assert bool(torch.isfinite(expected).all()), "drew a filtered token"
        torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=1e-5)
        if strategy.decoding_method == "greedy":
            assert torch.equal(chosen, logits.argmax(-1))


# ------------------------------------------------------------------------------ the loop


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def prompt_ids(tokenizer) -> list[list[int]]:
    texts = ["What is 2 + 3?", "hi", "Count to five, please.", "A longer prompt than the others, by a few words."]
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in texts
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]


def staggered_eos(model, tokenizer, ids: list[list[int]], strategy: GenerateStrategyConfig) -> int:
    """A token to declare EOS so that greedy rows end at as many different steps as possible."""
    probe = HFGeneration(model, tokenizer, "generate").generate(ids, strategy)
    responses = [probe["input_ids"][row, len(ids[row]) : int(probe["input_lengths"][row])].tolist()
                 for row in range(len(ids))]

    def end_steps(token: int) -> set[int]:
        return {response.index(token) if token in response else -1 for response in responses}

    return max(sorted({token for response in responses for token in response}), key=lambda t: len(end_steps(t)))


@pytest.mark.parametrize("equal_lengths", [False, True], ids=["padded", "unpadded"])
def test_greedy_equals_generate_when_rows_end_at_different_steps(tokenizer, equal_lengths):
    # The teacher preset (larger initial weights) gives varied greedy continuations.
    model = build_tiny_model("teacher").eval()
    ids = prompt_ids(tokenizer)
    if equal_lengths:  # no left padding: the loop then passes no attention mask at all
        shortest = min(map(len, ids))
        ids = [prompt[-shortest:] for prompt in ids]
    strategy = GenerateStrategyConfig(decoding_method="greedy", max_length=12)
    eos = staggered_eos(model, tokenizer, ids, strategy)
    ours = HFGeneration(model, tokenizer, "opd")
    theirs = HFGeneration(model, tokenizer, "generate")
    ours.stop_ids = theirs.stop_ids = (eos,)
    a, b = ours.generate(ids, strategy), theirs.generate(ids, strategy)
    for key in ("input_ids", "input_lengths", "response_lengths", "truncated"):
        assert torch.equal(a[key], b[key]), key
    assert len(set(a["response_lengths"].tolist())) > 1, "rows should end at different steps"
    # float32 rounding only: once rows leave the batch the matmuls have other shapes.
    torch.testing.assert_close(a["generation_logprobs"], b["generation_logprobs"], rtol=0, atol=1e-4)


def test_finished_rows_are_no_longer_fed_to_the_model(tokenizer):
    model = build_tiny_model("teacher").eval()
    ids = prompt_ids(tokenizer)
    strategy = GenerateStrategyConfig(decoding_method="greedy", max_length=12)
    eos = staggered_eos(model, tokenizer, ids, strategy)
    batch_sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True
    )
    try:
        width = max(map(len, ids))
        left = torch.full((len(ids), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(left)
        for row, prompt in enumerate(ids):
            left[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            tokens, _ = decode(model, left, mask, strategy, [eos], tokenizer.pad_token_id, return_logprobs=False)
    finally:
        hook.remove()
    # Forward k (k ≥ 1) computes step k's logits: it must hold exactly the rows that have
    # not produced EOS in steps 0 … k-1.
    ended_by = (tokens == eos).int().cumsum(dim=1) > 0
    expected = [len(ids)] + [int((~ended_by[:, step - 1]).sum()) for step in range(1, tokens.shape[1])]
    assert batch_sizes == expected
    assert min(batch_sizes) < len(ids)


# ------------------------------------------------------------------ compiled decode step


@pytest.mark.skipif(compiler_toolchain_problem("cpu") is not None, reason="torch.compile needs a C++ compiler on CPU")
def test_compiled_step_equals_eager_and_follows_in_place_weight_updates(tokenizer):
    """generation.compile_decode: same tokens as the eager loop, before and after an optimizer-like update.

    Rows end at different steps (the batch shrinks down to one row, which torch compiles
    separately), prompts are padded (an attention mask is passed). The weights are then
    changed in place, as the optimizer does: a compiled step that had baked them in as
    constants would keep producing the old model's tokens.
    """
    torch.manual_seed(0)
    model = build_tiny_model("teacher").eval()
    ids = prompt_ids(tokenizer)
    strategy = GenerateStrategyConfig(decoding_method="greedy", max_length=12)
    eos = staggered_eos(model, tokenizer, ids, strategy)
    eager = HFGeneration(model, tokenizer, "opd")
    compiled = HFGeneration(model, tokenizer, "opd", compile_decode=True)
    assert compiled.step_forward is not None
    eager.stop_ids = compiled.stop_ids = (eos,)
    generated = []
    for update in range(2):
        if update:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.05)
        a, b = eager.generate(ids, strategy), compiled.generate(ids, strategy)
        for key in ("input_ids", "input_lengths", "response_lengths", "truncated"):
            assert torch.equal(a[key], b[key]), (update, key)
        torch.testing.assert_close(a["generation_logprobs"], b["generation_logprobs"], rtol=0, atol=1e-4)
        generated.append(a["input_ids"])
    # The update changed what the model generates, so stale weights could not have passed.
    assert generated[0].shape != generated[1].shape or not torch.equal(*generated)


def test_compile_decode_true_without_a_compiler_names_the_key(monkeypatch):
    monkeypatch.setattr("opd.utils.compile_cache.shutil.which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="generation.compile_decode"):
        resolve_compile_kernels(True, "cpu", "generation.compile_decode")
    assert resolve_compile_kernels("auto", "cpu", "generation.compile_decode") is False
