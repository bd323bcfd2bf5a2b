"""Tiny Qwen2-architecture models and a byte-level tokenizer, built locally.

Real Hugging Face models for tests and the CPU demo without downloads: a byte-level tokenizer with no merges
(any text round-trips) with ChatML tokens and template, and seeded ``Qwen2ForCausalLM`` presets that resolve
``tiny:<preset>`` paths. Two processes building the same preset get bitwise-identical weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config

from opd.utils.errors import ConfigError

if TYPE_CHECKING:  # imported where a model is built: it loads transformers' modeling stack (seconds)
    from transformers import Qwen2ForCausalLM

TINY_PREFIX = "tiny:"

# ChatML (Qwen2.5-Instruct's format) without Qwen's default system prompt. With ``tools``, they are listed in the
# system turn, called as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and results come back in one user
# turn inside <tool_response> tags, as Qwen2.5 does. Without tools it is plain ChatML.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nThese functions can be called. Their signatures, one JSON object each, are inside <tools></tools>:\n"
    # HF renders templates with trim_blocks: a newline right after a block tag is written as {{ '\\n' }}.
    "<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "To call one, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    # An assistant turn recorded with structured calls (fixed multi-turn data): written as Qwen2.5 writes them.
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": {{ call[\'arguments\'] | tojson }}}\n</tool_call>'
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]


@dataclass(frozen=True)
class TinyPreset:
    """Shape of a tiny Qwen2 model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seed: int
    initializer_range: float = 0.02


TINY_PRESETS: dict[str, TinyPreset] = {
    # Wider and deeper than the student; larger initial weights give it peaked distributions to learn from
    # (a default-initialised model is nearly uniform).
    "teacher": TinyPreset(128, 256, 4, 4, 2, seed=1234, initializer_range=0.2),
    "student": TinyPreset(64, 128, 2, 4, 2, seed=4321),
    # A second, independently initialised model of the student's shape (for tests).
    "student-b": TinyPreset(64, 128, 2, 4, 2, seed=999),
    # The CPU demo's models (examples/demo/prepare_models.py), with 32-dimensional heads, the smallest vLLM's CPU
    # attention kernels take.
    "demo-teacher": TinyPreset(128, 512, 4, 4, 2, seed=11),
    "demo-student": TinyPreset(128, 256, 2, 4, 2, seed=12),
    # The λ study's capacity-gap students (examples/demo/prepare_study_models.py).
    "study-student-small": TinyPreset(64, 128, 1, 2, 1, seed=13),
    "study-student-tiny": TinyPreset(32, 64, 1, 1, 1, seed=14),
}


def is_tiny_path(path: str | None) -> bool:
    """Whether a model/tokenizer path names a locally built tiny model (``tiny:<preset>``)."""
    return isinstance(path, str) and path.startswith(TINY_PREFIX)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of the tiny models: 256 byte tokens, then pad, ``<|im_start|>``, EOS ``<|im_end|>``."""
    byte_alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(byte_alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text maps to its bytes one to one.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Trains a small byte-level BPE tokenizer on a task's text (deterministic for the same texts).

    It pre-splits as Qwen2's tokenizer does (``PRETOKENIZE_REGEX``), because ``AutoTokenizer`` reloads a tokenizer
    saved beside a Qwen2 model as ``Qwen2Tokenizer`` with that split. Special tokens and template are those of
    :func:`build_tiny_tokenizer`; ``vocab_size`` is an upper bound.
    """
    from tokenizers import Regex
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_model_for_tokenizer(preset_name: str, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A randomly initialised tiny preset sized for ``tokenizer``'s vocabulary (deterministic)."""
    config = tiny_model_config(preset_name, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_PRESETS[preset_name].seed)
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tiny_model_config(preset_name: str, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """Returns the ``Qwen2Config`` of a tiny preset sized for ``tokenizer``; ConfigError if the name is unknown."""
    if preset_name not in TINY_PRESETS:
        raise ConfigError(
            f"unknown tiny model '{TINY_PREFIX}{preset_name}'; available: "
            + ", ".join(TINY_PREFIX + name for name in TINY_PRESETS)
        )
    preset = TINY_PRESETS[preset_name]
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=4096,
        initializer_range=preset.initializer_range,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(preset_name: str, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A seeded tiny Qwen2 causal LM of ``preset_name`` (no ``tiny:`` prefix), in train mode, for the tiny tokenizer."""
    model = build_model_for_tokenizer(preset_name, build_tiny_tokenizer())
    torch.nn.Module.to(model, dtype)  # in place (transformers' typing of its own .to() is unusable here)
    return model


def save_tiny_pair(directory: str, preset_name: str) -> str:
    """Saves a tiny model and its tokenizer as an HF model directory and returns the directory."""
    build_tiny_model(preset_name).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory
