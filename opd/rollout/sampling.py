"""From next-token logits to a sampled token: temperature / top-k / top-p, then a draw.

The warpers match transformers' temperature, top-k and top-p warpers, so ``generate_strategy`` means the same in
opd's decode loop and in ``generate``. The draw is an inverse-CDF lookup rather than ``torch.multinomial``, whose
one variate per vocabulary entry costs more than the LM head on CPU; it needs one uniform per row. Sums are float64
(a float32 total over 151k entries is not exact), in two levels over a long vocabulary: a block from the block
masses, then the entry inside it. Entries with probability 0 are never drawn.
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
    """Applies a sampling strategy's temperature and filter to ``[B, V]`` logits: float32, filtered entries ``-inf``."""
    return strategy.method.keep(logits.float() / strategy.temperature, strategy)


def sample_from_probs(
    probs: torch.Tensor, uniforms: torch.Tensor | None = None, block_size: int = CDF_BLOCK_SIZE
) -> torch.Tensor:
    """Draws one index per row with probability proportional to ``probs`` (two-level inverse CDF).

    Args:
        probs: ``[B, V]`` non-negative weights, each row with a positive sum (not necessarily 1).
        uniforms: ``[B]`` values in ``[0, 1)`` instead of fresh float64 ``torch.rand`` draws (reproducibility).

    Returns:
        ``[B]`` int64 indices: ``i`` where ``u · total`` falls in ``[cdf[i-1], cdf[i])`` of the float64 CDF.
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
    """Moves a lookup that ran off the end of the CDF (rounding put the target at the total) to the last positive entry.

    With ``right=True`` a zero-weight entry can only come back that way: its CDF equals the previous entry's.
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
    """Chooses each row's next token from ``[B, V]`` logits: ``([B] ids, [B] float32 log-probs or None)``.

    Greedy takes the arg-max and its log-prob under the unwarped softmax (as ``generate``'s scores give); sampling
    draws from the warped distribution.
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
