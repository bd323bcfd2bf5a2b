"""opd's KV-cache decode loop for an in-process Hugging Face causal LM.

It covers the student's case of ``model.generate`` (sampling or greedy, one sequence per row, stop at any stop
token or after ``max_new_tokens``), but finished rows leave the batch (``Cache.batch_select_indices``) and tokens
are drawn by an exact inverse-CDF lookup (:func:`opd.rollout.sampling.sample_from_probs`), cheaper than
``torch.multinomial`` at a large vocabulary. Position ids come from the left-padded prompts' mask as in
``generate``, so greedy decoding reproduces its tokens.

``generation.compile_decode`` runs the one-token steps through ``torch.compile`` (:func:`compile_decode_step`),
which removes a small model's per-operator overhead; the prefill stays eager, as prompt widths vary per batch.
Inductor's ``cpp_wrapper`` is not used: it slows the rest of a training step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from opd.models.decoding import GenerateStrategyConfig
from opd.models.lm_head import output_layer_of
from opd.rollout.sampling import next_tokens
from opd.rollout.stop_tokens import is_stop
from opd.utils.compile_cache import compile_function

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel


def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    strategy: GenerateStrategyConfig,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    return_logprobs: bool,
    step_forward: Callable[..., Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Generates up to ``strategy.max_length`` new tokens per row (under ``torch.inference_mode()``, model in eval).

    Args:
        model: a causal LM taking a KV cache (``cache`` or ``past_key_values``), ``position_ids``, ``logits_to_keep``.
        input_ids: ``[B, P]`` left-padded prompts on the model's device; ``attention_mask`` is 0 on the padding.
        stop_token_ids: the tokens that end a response (the one emitted is kept).
        step_forward: runs the one-token steps instead of ``model`` (:func:`compile_decode_step`).

    Returns:
        ``([B, T] new tokens, [B, T] float32 sampling log-probs or None)``, ``T`` the longest response; after a
        row's stop token its positions hold ``pad_token_id`` and log-prob 0.
    """
    rows = input_ids.shape[0]
    device = input_ids.device
    budget = strategy.max_length
    tokens = torch.full((rows, budget), pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, budget), dtype=torch.float32, device=device) if return_logprobs else None
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)

    cache = DynamicCache(config=model.config)
    cache_keyword = _cache_keyword(model)
    output, position_ids, mask = _prefill(model, input_ids, attention_mask, cache, cache_keyword)
    active = torch.arange(rows, device=device)  # original row of each row still decoding
    next_position = position_ids[:, -1:] + 1
    steps_run = 0
    for step in range(budget):
        chosen, chosen_logprobs = next_tokens(output.logits[:, -1, :], strategy, return_logprobs)
        tokens[active, step] = chosen
        if logprobs is not None and chosen_logprobs is not None:
            logprobs[active, step] = chosen_logprobs
        steps_run = step + 1
        still_running = ~is_stop(chosen, stops)
        if step == budget - 1 or not bool(still_running.any()):
            break
        if not bool(still_running.all()):
            keep = still_running.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            active, chosen, next_position = active[keep], chosen[keep], next_position[keep]
            mask = mask[keep] if mask is not None else None
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        output = (step_forward or model)(
            input_ids=chosen.unsqueeze(-1),
            attention_mask=mask,
            position_ids=next_position,
            use_cache=True,
            **{cache_keyword: cache},
        )
        next_position = next_position + 1
    return tokens[:, :steps_run], logprobs[:, :steps_run] if logprobs is not None else None


def _prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: DynamicCache,
    cache_keyword: str,
) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """The prompts' forward into ``cache``: ``(its output, the prompts' position ids, the mask to extend)``.

    The mask is None without padding, so the attention kernel takes its causal fast path (finished rows leave the
    batch, so no padding appears later).
    """
    # As generate: position = number of real tokens before it; padding gets position 0.
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    mask = attention_mask if not bool(attention_mask.all()) else None
    output = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: cache},
    )
    return output, position_ids, mask


def compile_decode_step(model: PreTrainedModel) -> Callable[..., Any]:
    """A one-token decode step with the model's decoder compiled and its output layer eager.

    Batch size and cache length stay symbolic, so a run compiles a handful of graphs, not one per step. The
    output layer stays eager (one large matrix product, which compiling slows down), unless the model transforms
    its logits after the head (soft-capping, scaling): then its whole ``forward`` is compiled. Parameters are graph
    inputs, so training updates them without recompiling.

    Returns:
        A callable with ``model``'s keyword arguments whose result has ``.logits`` ``[B, 1, V]`` (last position).
    """
    try:
        plain_head = not output_layer_of(model).transforms_logits
    except ValueError:  # not a linear layer, or a transform opd does not know: the model's forward applies it
        plain_head = False
    if not plain_head:
        return compile_function(model.forward)
    decoder = compile_function(model.get_decoder().forward)

    def step(input_ids: torch.Tensor, **inputs: Any) -> SimpleNamespace:
        embeds = model.get_input_embeddings()(input_ids)
        hidden = decoder(inputs_embeds=embeds, **inputs).last_hidden_state[:, -1:]
        return SimpleNamespace(logits=model.get_output_embeddings()(hidden))

    return step


def _cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword of the KV cache: ``cache`` from transformers 5.24 on, ``past_key_values`` before."""
    forward = getattr(model, "forward", model)
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
