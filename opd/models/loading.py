"""Loading the tokenizer, student and teacher, and checking that they can be paired.

Teacher and student must share a tokenizer: the divergence compares their
distributions entry by entry over token ids, so id 1234 must mean the same string in
both. :func:`check_tokenizer_compatibility` fails early, with the first difference, when
they do not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from opd.models.config import ModelLoadingConfig
from opd.models.tiny import TINY_PREFIX, build_tiny_model, build_tiny_tokenizer, is_tiny_path
from opd.utils.errors import ConfigError, ModelCompatibilityError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on GPUs that support it, float32 otherwise (CPU)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[name]


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """Loads a tokenizer (or builds the tiny one) and makes sure it can pad.

    Raises:
        ConfigError: if the tokenizer cannot be loaded or has no EOS token.
    """
    tokenizer: Any
    if is_tiny_path(path):
        tokenizer = build_tiny_tokenizer()
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            raise ConfigError(f"cannot load tokenizer from '{path}': {str(error).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer '{path}' has no EOS token; generation could never stop")
    if tokenizer.pad_token_id is None:
        # Padding never carries loss or attention, so EOS is a safe stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"tokenizer '{path}' has no chat template; set data.chat_template in the config")
    return tokenizer


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, config: ModelLoadingConfig) -> PreTrainedModel:
    """Loads ``AutoModelForCausalLM`` (or builds ``tiny:<preset>``) on ``device``.

    Raises:
        ConfigError: if the model cannot be loaded.
    """
    model: PreTrainedModel
    if is_tiny_path(path):
        model = build_tiny_model(path[len(TINY_PREFIX) :], dtype=dtype)
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": config.trust_remote_code}
        if config.attn_implementation:
            kwargs["attn_implementation"] = config.attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as error:
            raise ConfigError(f"cannot load model from '{path}': {str(error).splitlines()[0]}") from None
    torch.nn.Module.to(model, device)  # in place (transformers' typing of its own .to() is unusable here)
    return model


def check_tokenizer_compatibility(
    student_tokenizer: Any, teacher_tokenizer: Any, student_name: str, teacher_name: str
) -> None:
    """Fails unless both tokenizers map every token string to the same id.

    Raises:
        ModelCompatibilityError: naming the first differing token, or size, or EOS.
    """
    student_vocab = student_tokenizer.get_vocab()
    teacher_vocab = teacher_tokenizer.get_vocab()
    if len(student_vocab) != len(teacher_vocab):
        raise ModelCompatibilityError(
            f"teacher '{teacher_name}' and student '{student_name}' have different tokenizers: "
            f"{len(teacher_vocab)} vs {len(student_vocab)} tokens. Token-level distillation needs "
            "one shared vocabulary (same model family)."
        )
    for token, token_id in student_vocab.items():
        if teacher_vocab.get(token) != token_id:
            raise ModelCompatibilityError(
                f"teacher '{teacher_name}' and student '{student_name}' have different tokenizers: "
                f"token {token!r} is id {token_id} in the student but {teacher_vocab.get(token)} "
                "in the teacher."
            )
    if student_tokenizer.eos_token_id != teacher_tokenizer.eos_token_id:
        raise ModelCompatibilityError(
            f"teacher '{teacher_name}' and student '{student_name}' use different EOS tokens "
            f"({teacher_tokenizer.eos_token!r} vs {student_tokenizer.eos_token!r})"
        )


def check_output_sizes(model: PreTrainedModel, vocab_size: int, name: str) -> None:
    """Fails if a model's output layer cannot score every token of the tokenizer."""
    output_size = model.get_output_embeddings().weight.shape[0]
    if output_size < vocab_size:
        raise ModelCompatibilityError(
            f"model '{name}' has {output_size} output logits but the tokenizer has "
            f"{vocab_size} tokens; the model does not fit this tokenizer"
        )
