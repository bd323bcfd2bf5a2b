"""Loading the tokenizer, student and teacher, and checking that they can be paired.

Token-level distillation compares distributions id by id, so (unless ``teacher.cross_tokenizer``) both must
share a tokenizer; :func:`check_tokenizer_compatibility` fails early with the first difference.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from opd.models.config import ModelLoadingConfig
from opd.models.gguf_source import gguf_source, load_gguf_causal_lm, load_gguf_tokenizer
from opd.models.lm_head import OutputLayer, output_layer_of
from opd.models.tiny import TINY_PREFIX, build_tiny_model, build_tiny_tokenizer, is_tiny_path
from opd.utils.config import resolve_auto
from opd.utils.devices import is_cuda, use_tf32_matmuls
from opd.utils.errors import ConfigError, ModelCompatibilityError, first_line

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    name = resolve_auto(name, lambda: "cuda" if torch.cuda.is_available() else "cpu")
    if is_cuda(name) and not torch.cuda.is_available():
        raise ConfigError("model.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on GPUs that support it, float32 otherwise (CPU)."""
    name = resolve_auto(name, lambda: "bfloat16" if is_cuda(device) and torch.cuda.is_bf16_supported() else "float32")
    return _DTYPES[name]


def load_tokenizer(
    path: str, trust_remote_code: bool = False, chat_template: str | None = None, require_chat_template: bool = True
) -> Any:
    """Loads a tokenizer (or builds the tiny one) and makes sure it can pad.

    ``chat_template`` replaces the tokenizer's own (``data.chat_template``); ``require_chat_template`` refuses a
    tokenizer left without one.

    Raises:
        ConfigError: if the tokenizer cannot be loaded, has no EOS token, or lacks a required chat template.
    """
    tokenizer: Any
    if is_tiny_path(path):
        tokenizer = build_tiny_tokenizer()
    elif (source := gguf_source(path)) is not None:
        tokenizer = load_gguf_tokenizer(source)
    else:
        _check_local_path(path, "tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            raise ConfigError(_loading_problem(path, error, "tokenizer")) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer '{path}' has no EOS token; generation could never stop")
    if tokenizer.pad_token_id is None:
        # Padding never carries loss or attention, so EOS is a safe stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        tokenizer.chat_template = chat_template
    if require_chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"tokenizer '{path}' has no chat template; set data.chat_template in the config")
    return tokenizer


_LOCAL_PREFIXES = ("/", "./", "../", "~")


def _check_local_path(path: str, what: str) -> None:
    """Raises ConfigError if a path that can only be local (absolute, ./, ../, ~, several '/') does not exist.

    Otherwise transformers takes it for a hub repository id and reports a malformed id.
    """
    looks_local = path.startswith(_LOCAL_PREFIXES) or path.count("/") > 1
    if looks_local and not Path(path).expanduser().exists():
        raise ConfigError(f"{what} directory '{path}' does not exist")


def _loading_problem(path: str, error: Exception, what: str = "model") -> str:
    """One line saying why ``path`` did not load, and what to do."""
    message = first_line(error)
    if "trust_remote_code" in str(error):
        return (
            f"cannot load {what} from '{path}': it needs its own Python code; set model.trust_remote_code = true "
            "if you trust that code"
        )
    damaged = _damaged_weights_file(Path(path).expanduser()) if what == "model" else None
    if damaged is not None:
        return f"cannot load model from '{path}': {damaged}; copy it again"
    return f"cannot load {what} from '{path}': {message}"


def _damaged_weights_file(directory: Path) -> str | None:
    """Which ``*.safetensors`` file of ``directory`` cannot be read through, and why, or None."""
    if not directory.is_dir():
        return None
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), not __contains__)
                    handle.get_slice(name)
        except (SafetensorError, OSError) as damage:
            return f"the weights file {file} is damaged or truncated ({first_line(damage)})"
    return None


def attention_implementation(
    requested: str | None, device: torch.device, dtype: torch.dtype, flash_attn_installed: Callable[[], bool]
) -> str | None:
    """The ``attn_implementation`` to load a model with (None: transformers' default), ``auto`` resolved.

    Flash attention runs on CUDA in 16 bits only, and needs the ``flash_attn`` package (transformers' own
    check). ``flash_attn_installed`` is asked only when the rest holds.
    """

    def choose() -> str | None:
        flash = is_cuda(device) and dtype in (torch.bfloat16, torch.float16) and flash_attn_installed()
        return "flash_attention_2" if flash else None

    return resolve_auto(requested, choose)


def attention_implementation_for(config: ModelLoadingConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """``config.attn_implementation`` for a model of ``dtype`` on ``device`` (:func:`attention_implementation`)."""
    return attention_implementation(
        config.attn_implementation, device, dtype, lambda: importlib.util.find_spec("flash_attn") is not None
    )


def load_causal_lm(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    config: ModelLoadingConfig,
    device_map: str | None = None,
) -> PreTrainedModel:
    """Loads ``AutoModelForCausalLM`` (or builds ``tiny:<preset>``, or dequantises a GGUF file) on ``device``.

    ``device_map`` (Accelerate's ``auto``, ``balanced``, ...) spreads the layers instead of using ``device``.
    Raises ConfigError if the model cannot be loaded.
    """
    use_tf32_matmuls(config.tf32, device)
    model: PreTrainedModel
    if is_tiny_path(path):
        model = build_tiny_model(path[len(TINY_PREFIX) :], dtype=dtype)
    elif (source := gguf_source(path)) is not None:
        model = load_gguf_causal_lm(source, dtype, attention_implementation_for(config, device, dtype))
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": config.trust_remote_code}
        if attention := attention_implementation_for(config, device, dtype):
            kwargs["attn_implementation"] = attention
        if device_map is not None:
            kwargs["device_map"] = device_map
        _check_local_path(path, "model")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError, SafetensorError) as error:
            raise ConfigError(_loading_problem(path, error)) from None
        if device_map is not None:
            return model
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
            "one shared vocabulary (same model family), or teacher.cross_tokenizer = true (the teacher "
            "scores the response text under its own tokenization; guide section 15)."
        )
    for token, token_id in student_vocab.items():
        if teacher_vocab.get(token) != token_id:
            raise ModelCompatibilityError(
                f"teacher '{teacher_name}' and student '{student_name}' have different tokenizers: "
                f"token {token!r} is id {token_id} in the student but {teacher_vocab.get(token)} "
                "in the teacher; set teacher.cross_tokenizer = true to distil across tokenizers (guide section 15)."
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


def load_output_layer(
    path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> OutputLayer:
    """Loads only a causal LM's output layer and logit transform, to turn a served teacher's hidden states into logits.

    The parameter names come from the architecture built on the meta device (which resolves tied embeddings);
    the tensor is read from the safetensors files alone. A GGUF source is dequantised whole.

    Raises:
        ConfigError: no such directory, no safetensors weights, no linear output layer, or the tensor is missing.
    """
    if is_tiny_path(path) or gguf_source(path) is not None:
        model = load_causal_lm(
            path, dtype, torch.device("cpu"), ModelLoadingConfig(trust_remote_code=trust_remote_code)
        )
        layer = output_layer_of(model, path)
        weight, bias = layer.weight.detach(), layer.bias
    else:
        directory = Path(path).expanduser()  # transformers takes an unexpanded '~/...' for a hub repository id
        if not directory.is_dir():
            raise ConfigError(f"the teacher's output layer is read from a local model directory; '{path}' is not one")
        try:
            config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            layer = output_layer_of(skeleton, path)
        except (OSError, ValueError) as error:
            raise ConfigError(f"cannot read the output layer of '{path}': {first_line(error)}") from None
        parameters = list(skeleton.named_parameters(remove_duplicate=False))
        weight_names = [name for name, parameter in parameters if parameter is layer.weight]
        bias_names = [name for name, parameter in parameters if layer.bias is not None and parameter is layer.bias]
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"'{path}' holds no *.safetensors files to read the teacher's output layer from")
        weight = _read_tensor(files, weight_names, path)
        bias = _read_tensor(files, bias_names, path) if bias_names else None
    return OutputLayer(
        weight.to(device=device, dtype=dtype),
        None if bias is None else bias.detach().to(device=device, dtype=dtype),
        layer.logit_multiplier,
        layer.logit_softcap,
    )


def _read_tensor(files: list[Path], names: list[str], path: str) -> torch.Tensor:
    """The first of ``names`` found in the safetensors ``files``."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    if name in handle.keys():  # noqa: SIM118 (safe_open has keys(), not __contains__)
                        return handle.get_tensor(name)
        except SafetensorError as error:
            raise ConfigError(f"cannot read {file}: {error}; the file is damaged or not safetensors") from None
    raise ConfigError(f"none of {names} is in the safetensors files of '{path}'")
