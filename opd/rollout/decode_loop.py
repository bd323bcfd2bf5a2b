"""opd's KV-cache decode loop for an in-process Hugging Face causal LM.

It does what ``model.generate`` does for the one case the student needs (sampling or
greedy, one sequence per row, stop at any stop token or after ``max_new_tokens``) and two things it does
not:

* **finished rows leave the batch.** When a row emits a stop token its cache entries are dropped
  (``Cache.batch_select_indices``) and later forward passes run on the remaining rows
  only; ``generate`` keeps computing every row until all have finished.
* **a cheap draw.** Tokens are drawn by an exact inverse-CDF lookup
  (:func:`opd.rollout.sampling.sample_from_probs`) instead of
  ``torch.multinomial``, whose per-entry random variates cost more than the LM head at a
  150k vocabulary on CPU.

Prompts arrive left-padded with their attention mask; position ids are derived from the
mask exactly as ``generate`` derives them, so greedy decoding reproduces ``generate``'s
tokens (tested).

Optionally the one-token steps run through a ``torch.compile``-d forward
(:func:`compile_decode_step`, config ``generation.compile_decode``). With a tiny model the
step is bound by per-operator overhead (Python and dispatch), which compiling removes.
(Inductor's C++ wrapper, ``cpp_wrapper``, makes the step alone faster still but slows the
rest of a training step, so it is not used.) The prefill stays eager: prompt widths
vary from batch to batch, one-token steps do not.
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
    """Generates up to ``strategy.max_length`` new tokens per row.

    Call it under ``torch.inference_mode()`` with the model in eval mode.

    Args:
        model: a causal LM accepting a KV cache (``cache`` or ``past_key_values``),
            ``position_ids`` and ``logits_to_keep``.
        input_ids: ``[B, P]`` left-padded prompts (on the model's device).
        attention_mask: ``[B, P]`` 1 for prompt tokens, 0 for the left padding.
        strategy: decoding method, temperature, top-k / top-p and the new-token budget.
        stop_token_ids: the tokens that end a response (the one emitted is kept in the output).
        pad_token_id: fills a row's positions after its stop token.
        return_logprobs: also return each token's log-prob under the sampling distribution.
        step_forward: runs the one-token steps instead of ``model`` (the compiled forward
            from :func:`compile_decode_step`); ``None`` calls ``model``.

    Returns:
        ``([B, T] new tokens, [B, T] float32 log-probs or None)`` where ``T`` is the number
        of decoding steps run (the longest response). Positions after a row's stop token hold
        ``pad_token_id`` and log-prob 0.
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
    tokens = tokens[:, :steps_run]
    return tokens, logprobs[:, :steps_run] if logprobs is not None else None


def _prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: DynamicCache,
    cache_keyword: str,
) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """The prompts' forward into ``cache``: ``(its output, the prompts' position ids, the mask to extend)``.

    The mask is None without padding: the causal structure alone is the mask then, and
    passing none lets the attention kernel take its causal fast path instead of building a
    mask every step. (Rows that finish leave the batch, so no padding ever appears later.)
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

    ``dynamic=True`` keeps the batch size (rows leave as they finish) and the cache length
    symbolic, so a run compiles a handful of graphs (with and without an attention mask,
    and once more for a single remaining row, which torch specialises) rather than one per
    step. Inductor fuses the decoder's small element-wise operators (norms, rotary
    embedding, SiLU), whose dispatch overhead is where a small model's step time goes.
    The output layer stays eager: at Qwen's vocabulary it is one large matrix product,
    which compiling makes slower, not faster (guide section 5). A model whose logits are
    transformed after the head (soft-capping, scaling) has its whole ``forward`` compiled
    instead. The parameters
    are graph inputs, so training updates them in place without recompiling.

    Returns:
        A callable with ``model``'s keyword arguments whose result has ``.logits``
        (``[B, 1, V]``: the last position only).
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
