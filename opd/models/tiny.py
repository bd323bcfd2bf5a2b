"""Tiny Qwen2-architecture models and a byte-level tokenizer, built locally.

Tests, the CPU demo and benchmarks need real Hugging Face models without downloading
anything. This module builds them from a config: a byte-level BPE tokenizer with no
merges (every UTF-8 byte is a token, so any text round-trips) plus ChatML special tokens
and a Qwen-style chat template, and randomly initialised ``Qwen2ForCausalLM`` models of a
few presets. A model path of the form ``tiny:<preset>`` in a config resolves here.

Everything is deterministic for a given seed, so two processes building ``tiny:student``
get bitwise-identical weights.
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

# ChatML, the format Qwen2.5-Instruct uses, without Qwen's default system prompt. With
# ``tools`` (multi-turn rollouts), tools are listed in the system turn and called the way
# Qwen2.5 calls them: the model writes <tool_call>{"name": ..., "arguments": ...}</tool_call>,
# and tool results come back in one user turn, each inside <tool_response> tags. Without
# tools and tool messages, the text is plain ChatML as before, byte for byte.
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
    # The teacher is wider and deeper than the student, as in a real distillation pair.
    # Its larger initial weights give it peaked, confident next-token distributions
    # (entropy ~3.4 nats of a possible 5.6), so there is something clear to learn from it;
    # a default-initialised model is nearly uniform.
    "teacher": TinyPreset(128, 256, 4, 4, 2, seed=1234, initializer_range=0.2),
    "student": TinyPreset(64, 128, 2, 4, 2, seed=4321),
    # A second, independently initialised model of the student's shape (for tests).
    "student-b": TinyPreset(64, 128, 2, 4, 2, seed=999),
    # The CPU demo's task models (examples/demo/prepare_models.py): trained with opd sft.
    # Both have attention heads of 32 dimensions, the smallest vLLM's CPU attention
    # kernels take, so the demo also runs with generation.backend=vllm.
    "demo-teacher": TinyPreset(128, 512, 4, 4, 2, seed=11),
    "demo-student": TinyPreset(128, 256, 2, 4, 2, seed=12),
    # The λ study's capacity-gap students (examples/demo/prepare_study_models.py): one
    # layer, narrower than the demo student, still with 32-dimensional heads.
    "study-student-small": TinyPreset(64, 128, 1, 2, 1, seed=13),
    "study-student-tiny": TinyPreset(32, 64, 1, 1, 1, seed=14),
}


def is_tiny_path(path: str | None) -> bool:
    """Whether a model/tokenizer path names a locally built tiny model (``tiny:<preset>``)."""
    return isinstance(path, str) and path.startswith(TINY_PREFIX)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Builds the byte-level tokenizer shared by all tiny models.

    Returns:
        A fast tokenizer with 256 byte tokens followed by ``<|endoftext|>`` (padding),
        ``<|im_start|>`` and ``<|im_end|>`` (end of turn, used as EOS), and a ChatML
        chat template.
    """
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

    It splits text exactly as Qwen2's tokenizer does (transformers' ``PRETOKENIZE_REGEX``:
    words, single digits, punctuation runs) before byte-level BPE. That is not only
    realistic: ``AutoTokenizer`` loads any tokenizer saved beside a Qwen2 model as a
    ``Qwen2Tokenizer`` and re-applies that split, so a tokenizer trained with another
    split would tokenize differently once saved and reloaded. Digits stay single tokens,
    every byte has a token, and the special tokens and ChatML template are those of
    :func:`build_tiny_tokenizer`.

    Args:
        texts: training text, e.g. rendered chat conversations of the task.
        vocab_size: upper bound on the vocabulary (fewer if the text has fewer merges).
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
    config = tiny_model_config(preset_name, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_PRESETS[preset_name].seed)
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tiny_model_config(preset_name: str, vocab_size: int, eos_token_id: int, pad_token_id: int) -> Qwen2Config:
    """Returns the ``Qwen2Config`` of a tiny preset.

    Raises:
        ConfigError: if the preset name is unknown.
    """
    if preset_name not in TINY_PRESETS:
        raise ConfigError(
            f"unknown tiny model '{TINY_PREFIX}{preset_name}'; available: "
            + ", ".join(TINY_PREFIX + name for name in TINY_PRESETS)
        )
    preset = TINY_PRESETS[preset_name]
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=4096,
        initializer_range=preset.initializer_range,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(preset_name: str, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """Builds a randomly initialised tiny Qwen2 causal LM, deterministically.

    Args:
        preset_name: a key of :data:`TINY_PRESETS` (without the ``tiny:`` prefix).
        dtype: parameter dtype.

    Returns:
        The model, in train mode, with a generation config whose EOS/pad tokens match
        :func:`build_tiny_tokenizer`.
    """
    model = build_model_for_tokenizer(preset_name, build_tiny_tokenizer())
    torch.nn.Module.to(model, dtype)  # in place (transformers' typing of its own .to() is unusable here)
    return model


def save_tiny_pair(directory: str, preset_name: str) -> str:
    """Builds a tiny model and its tokenizer and saves both as an HF model directory.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained``.
    """
    build_tiny_model(preset_name).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory
