"""A model's shape (its ``config.json``) without its weights, for planning memory at real sizes.

A path's config comes from a ``tiny:`` preset, a local directory, a GGUF file's metadata, or, for hub names whose
configs ship in ``opd/models/shapes/`` (Qwen2.5-0.5B/1.5B/7B/32B-Instruct), from opd itself, so ``opd plan``
works offline at those sizes.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from opd.models.gguf_source import gguf_source, load_gguf_config, load_gguf_tokenizer
from opd.models.tiny import TINY_PREFIX, build_tiny_tokenizer, is_tiny_path, tiny_model_config
from opd.utils.errors import ConfigError

SHAPES_DIR = Path(__file__).parent / "shapes"
"""One directory per shipped model, named as on the Hugging Face hub without the owner."""
SHIPPED_OWNER = "Qwen"
SHIPPED_TOKENIZER_SIZE = 151_669
"""Tokens of the Qwen2.5 tokenizer (the models' 151,936 output rows include unused padding)."""


def shipped_shapes() -> list[str]:
    """The hub names whose configs ship with opd (``Qwen/Qwen2.5-32B-Instruct``, ...)."""
    return sorted(f"{SHIPPED_OWNER}/{path.parent.name}" for path in SHAPES_DIR.glob("*/config.json"))


def model_config(path: str) -> PretrainedConfig:
    """The config of the model at ``path`` (see the module docstring); ConfigError naming it if none is found."""
    if is_tiny_path(path):
        return tiny_model_config(path[len(TINY_PREFIX) :], build_tiny_tokenizer())
    if (source := gguf_source(path)) is not None:
        return load_gguf_config(source)
    directory = Path(path).expanduser()
    if (directory / "config.json").is_file():
        return AutoConfig.from_pretrained(str(directory))
    owner, _, name = path.partition("/")
    shipped = SHAPES_DIR / name / "config.json"
    if owner == SHIPPED_OWNER and name and shipped.is_file():
        return AutoConfig.from_pretrained(str(shipped.parent))
    raise ConfigError(
        f"no config.json for model '{path}': give a local model directory, a tiny: preset, or one of the shapes "
        f"that ship with opd ({', '.join(shipped_shapes())})"
    )


def tokenizer_size(path: str) -> int:
    """Tokens of the tokenizer at ``path``, found as :func:`model_config` finds the config."""
    if is_tiny_path(path):
        return len(build_tiny_tokenizer())
    if (source := gguf_source(path)) is not None:
        return len(load_gguf_tokenizer(source))
    directory = Path(path).expanduser()
    if directory.is_dir():
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(str(directory)))
    model_config(path)  # a shipped shape, or the error naming the path
    return SHIPPED_TOKENIZER_SIZE
