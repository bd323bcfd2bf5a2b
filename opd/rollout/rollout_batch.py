"""The batch every generation backend returns: ``[prompt | response | pad]`` rows.

Backends differ in how they sample; what leaves them is the same right-padded layout
with lengths, the sampler's per-token log-probs and a truncation flag, built here once so
that the HF loop and vLLM cannot drift apart in a shift or a mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opd.data.batched_data_dict import BatchedDataDict


def build_rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[torch.Tensor | Sequence[int]],
    response_logprobs: Sequence[torch.Tensor | Sequence[float]] | None,
    truncated: Sequence[bool] | torch.Tensor,
    pad_token_id: int,
) -> BatchedDataDict:
    """Lays sampled responses out as right-padded rows (see ``GenerationInterface.generate``).

    Args:
        prompts: the prompt ids of each row.
        responses: the response ids of each row, up to and including its EOS (if any).
        response_logprobs: the sampler's log-prob of each response token, or None when
            nobody asked for them (the batch then has no ``generation_logprobs``).
        truncated: per row, True when the response ended without an EOS.
        pad_token_id: fills the rows past their length.

    Returns:
        ``input_ids [N, L]``, ``input_lengths``, ``prompt_lengths``, ``response_lengths``,
        ``truncated`` and, if log-probs were given, ``generation_logprobs [N, L]`` (each
        response token's log-prob at that token's position, 0 elsewhere).
    """
    if len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} responses for {len(prompts)} prompts")
    prompt_lengths = torch.tensor([len(prompt) for prompt in prompts], dtype=torch.long)
    response_lengths = torch.tensor([len(response) for response in responses], dtype=torch.long)
    input_lengths = prompt_lengths + response_lengths
    width = int(input_lengths.max()) if len(prompts) else 0
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(prompts), width), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        p, r = len(prompt), len(response)
        input_ids[row, :p] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[row, p : p + r] = torch.as_tensor(response, dtype=torch.long)
        if response_logprobs is not None:
            logprobs[row, p : p + r] = torch.as_tensor(response_logprobs[row], dtype=torch.float32)
    batch = BatchedDataDict(
        input_ids=input_ids,
        input_lengths=input_lengths,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        truncated=torch.as_tensor(truncated, dtype=torch.bool).reshape(len(prompts)),
    )
    if response_logprobs is not None:
        batch["generation_logprobs"] = logprobs
    return batch
