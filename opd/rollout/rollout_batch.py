"""The batch every generation backend returns: ``[prompt | response | pad]`` rows.

Built here once so the backends cannot drift apart in a shift or a mask.
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
    """Lays sampled responses (each up to and including its EOS, if any) out as right-padded rows.

    Returns:
        ``input_ids [N, L]``, ``input_lengths``, ``prompt_lengths``, ``response_lengths``, ``truncated`` and, if
        ``response_logprobs`` is not None, ``generation_logprobs [N, L]`` (0 off the response tokens).
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
