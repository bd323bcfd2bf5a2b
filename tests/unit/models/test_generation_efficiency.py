"""Generation does only the work it needs: the KV cache is used at every decoding step,
and a batch stops as soon as every sequence has produced EOS."""

from __future__ import annotations

import pytest
import torch

from opd.models.decoding import GenerateStrategyConfig
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.rollout.hf_generation import HFGeneration

GREEDY = GenerateStrategyConfig(decoding_method="greedy", max_length=40)
THREE_TOKENS = GenerateStrategyConfig(decoding_method="greedy", max_length=3)


class ForwardRecorder:
    """Records, for each forward call of a model, how many new tokens it was fed and
    whether it got a KV cache from the previous step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, bool]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        # transformers 5.24 renamed generate's `past_key_values` keyword to `cache`.
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        self.calls.append((int(input_ids.shape[1]), cache is not None and cache.get_seq_length() > 0))


def prompts(tokenizer) -> list[list[int]]:
    texts = ["What is 2 + 3?", "hi", "Count to five, please."]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=False) for text in texts]


DECODE_LOOPS = pytest.mark.parametrize("decode_loop", ["opd", "generate"])


@DECODE_LOOPS
def test_every_decoding_step_after_the_prompt_reuses_the_cache(decode_loop):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("student")
    recorder = ForwardRecorder(model)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts(tokenizer)]
    batch = HFGeneration(model, tokenizer, decode_loop).generate(ids, GREEDY, 1)
    steps = int(batch["response_lengths"].max())
    # One prefill over the whole (left-padded) prompt, then one token per step from the cache.
    assert recorder.calls[0] == (max(map(len, ids)), False)
    assert recorder.calls[1:] == [(1, True)] * (len(recorder.calls) - 1)
    assert len(recorder.calls) <= steps


@DECODE_LOOPS
def test_batch_stops_when_every_sequence_has_ended(decode_loop):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("student")
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts(tokenizer)]
    # Find the greedy continuation of each prompt, then declare the token each row emits
    # at step 3 the EOS of a second generation: every row ends by its third token.
    probe = HFGeneration(model, tokenizer).generate(ids, THREE_TOKENS, 1)
    third_tokens = {int(probe["input_ids"][row, int(probe["prompt_lengths"][row]) + 2]) for row in range(len(ids))}
    if len(third_tokens) != 1:  # rows disagree: use one row only, so a single EOS id suffices
        ids = ids[:1]
        third_tokens = {int(probe["input_ids"][0, int(probe["prompt_lengths"][0]) + 2])}
    generation = HFGeneration(model, tokenizer, decode_loop)
    generation.stop_ids = (third_tokens.pop(),)
    recorder = ForwardRecorder(model)
    batch = generation.generate(ids, GREEDY, 1)
    assert int(batch["response_lengths"].max()) <= 3
    assert not batch["truncated"].any()
    assert len(recorder.calls) <= 3, "decoding must stop once every row has emitted EOS, not run to max_length=40"


@DECODE_LOOPS
def test_logprobs_only_when_asked_and_the_same_tokens_either_way(decode_loop):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("student")
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts(tokenizer)]
    generation = HFGeneration(model, tokenizer, decode_loop)
    with_logprobs = generation.generate(ids, GREEDY, 1)
    without = generation.generate(ids, GREEDY, 1, return_logprobs=False)
    assert "generation_logprobs" in with_logprobs and "generation_logprobs" not in without
    for key in ("input_ids", "input_lengths", "prompt_lengths", "response_lengths", "truncated"):
        assert torch.equal(with_logprobs[key], without[key]), key
