"""From next-token logits to a sampled token: temperature / top-k / top-p, then a draw.

The warpers reproduce transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``
and ``TopPLogitsWarper`` (tested against them), so ``generate_strategy`` means the same
thing in opd's decode loop and in ``generate``.

The draw is an inverse-CDF lookup instead of ``torch.multinomial``. On CPU,
``multinomial`` draws one exponential variate per vocabulary entry (an exponential race),
and at a large vocabulary the random number generator costs more than the LM head
itself. The inverse CDF needs one uniform variate per row (timings: guide section 5,
"Where a step's time goes"). The cumulative sums are float64, so each entry's probability
is exact up to float64 rounding (a float32 running total over 151k entries would not
be). Over a long vocabulary the lookup works in two levels, which is cheaper than one
float64 cumsum of every entry: pick a block of entries from the cumulative block masses,
then the entry inside that block. Entries with probability 0 (masked by top-k / top-p)
can never be drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opd.models.decoding import GenerateStrategyConfig

CDF_BLOCK_SIZE = 1024
"""Entries per block of the two-level inverse CDF (≈ √V at Qwen's vocabulary: both levels short)."""
SINGLE_LEVEL_MAX_BLOCKS = 4
"""Up to this many blocks (4,096 entries) one float64 CDF is cheaper than two levels."""


def warp_logits(logits: torch.Tensor, strategy: GenerateStrategyConfig) -> torch.Tensor:
    """Applies the strategy's temperature and its decoding method's filter (top-k, top-p).

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; the result is float32).
        strategy: a sampling strategy (``decoding_method`` ``top_k`` or ``top_p``).

    Returns:
        ``[B, V]`` float32 logits of the sampling distribution; filtered entries are ``-inf``.
    """
    return strategy.method.keep(logits.float() / strategy.temperature, strategy)


def sample_from_probs(
    probs: torch.Tensor, uniforms: torch.Tensor | None = None, block_size: int = CDF_BLOCK_SIZE
) -> torch.Tensor:
    """Draws one index per row with probability proportional to ``probs`` (two-level inverse CDF).

    Args:
        probs: ``[B, V]`` non-negative weights; each row must have a positive sum (it need
            not be exactly 1).
        uniforms: ``[B]`` values in ``[0, 1)`` to use instead of fresh ``torch.rand``
            draws (float64); for tests and reproducibility checks.
        block_size: entries per first-level block.

    Returns:
        ``[B]`` int64 indices; index ``i`` is returned when ``u · total`` falls in
        ``[cdf[i-1], cdf[i])`` of the float64 cumulative distribution.
    """
    rows, vocab = probs.shape
    blocks = -(-vocab // block_size)
    if uniforms is None:
        uniforms = torch.rand(rows, dtype=torch.float64, device=probs.device)
    if blocks <= SINGLE_LEVEL_MAX_BLOCKS:
        # A short vocabulary: one float64 CDF is as exact and takes fewer operations.
        cdf = probs.double().cumsum(dim=-1)
        drawn = torch.searchsorted(cdf, uniforms.to(torch.float64).unsqueeze(-1) * cdf[:, -1:], right=True)
        return _never_zero(probs, drawn).squeeze(-1)
    padded = F.pad(probs, (0, blocks * block_size - vocab)).view(rows, blocks, block_size)
    block_mass = padded.sum(dim=-1, dtype=torch.float64)  # [B, blocks]
    block_cdf = block_mass.cumsum(dim=-1)
    target = uniforms.to(torch.float64).unsqueeze(-1) * block_cdf[:, -1:]  # [B, 1]
    chosen_block = _never_zero(block_mass, torch.searchsorted(block_cdf, target, right=True))
    mass_before = F.pad(block_cdf[:, :-1], (1, 0)).gather(-1, chosen_block)
    inside = padded.gather(1, chosen_block.unsqueeze(-1).expand(rows, 1, block_size)).squeeze(1).double()
    offset = _never_zero(inside, torch.searchsorted(inside.cumsum(dim=-1), target - mass_before, right=True))
    return (chosen_block * block_size + offset).squeeze(-1)


def _never_zero(weights: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """Moves a lookup that ran off the end of the CDF to the row's last positive entry.

    With ``right=True`` a zero-weight entry i can only be returned past the end: its
    cumulative sum equals entry i−1's, which would have been returned first. Past the end
    happens when rounding puts the target at the total; that row then gets its last
    entry with weight (checked lazily: it is rare, and the check is one gather).
    """
    drawn = drawn.clamp(max=weights.shape[-1] - 1)
    hit_zero = weights.gather(-1, drawn) <= 0
    if bool(hit_zero.any()):
        from_end = (weights.flip(-1) > 0).int().argmax(dim=-1, keepdim=True)
        drawn = torch.where(hit_zero, weights.shape[-1] - 1 - from_end, drawn)
    return drawn


def next_tokens(
    logits: torch.Tensor, strategy: GenerateStrategyConfig, return_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chooses each row's next token, and (if asked) its log-prob under the sampling distribution.

    Args:
        logits: ``[B, V]`` next-token logits.
        strategy: greedy takes the arg-max; top_k / top_p sample from the warped distribution.
        return_logprobs: also return ``log p(token)`` under the distribution sampled from
            (for greedy, the unwarped softmax, as ``generate``'s scores give).

    Returns:
        ``([B] token ids, [B] float32 log-probs or None)``.
    """
    if strategy.is_greedy:
        warped = logits.float()
        chosen = warped.argmax(dim=-1)
    else:
        warped = warp_logits(logits, strategy)
        chosen = sample_from_probs(torch.softmax(warped, dim=-1))
    if not return_logprobs:
        return chosen, None
    logprobs = warped.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(warped, dim=-1)
    return chosen, logprobs
