"""A student made from its teacher: keep some of its decoder layers (``opd prune``).

The student starts as the teacher with fewer layers (as in DistilBERT and Minitron), so it shares the teacher's
tokenizer and chat format. Layers kept: ``even`` (evenly spaced, first and last included) or ``importance``
(highest block importance ``1 − cos(x_in, x_out)`` on calibration text, as in Minitron and ShortGPT).

The model is built anew from a config with fewer layers, so each layer's own index (its KV cache slot and
attention kind) is right; per-layer config lists such as ``layer_types`` keep the kept layers' entries.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from opd.utils.errors import ConfigError

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PretrainedConfig, PreTrainedModel

PRUNING_RECORD = "opd_pruning.json"
"""Written beside the pruned model: its source, the layers kept and how they were chosen."""

LAYER_CHOICES = ("even", "importance")


def evenly_spaced_layers(total: int, keep: int) -> list[int]:
    """``keep`` of ``total`` layer indices, evenly spaced, the first and last included (for ``keep`` ≥ 2).

    Raises:
        ConfigError: ``keep`` is not between 1 and ``total``.
    """
    _check_count(total, keep)
    if keep == 1:
        return [0]
    return sorted({round(index * (total - 1) / (keep - 1)) for index in range(keep)})


def most_important_layers(importance: Sequence[float], keep: int) -> list[int]:
    """The ``keep`` layers of highest importance, in model order (ties: the earlier layer stays)."""
    _check_count(len(importance), keep)
    ranked = sorted(range(len(importance)), key=lambda index: (-importance[index], index))
    return sorted(ranked[:keep])


def _check_count(total: int, keep: int) -> None:
    if not 1 <= keep <= total:
        raise ConfigError(f"opd prune: --layers must be between 1 and the model's {total} layers, got {keep}")


def decoder_layers(model: PreTrainedModel) -> tuple[str, torch.nn.ModuleList]:
    """The qualified name and module list of a causal LM's decoder layers; ConfigError if no ``layers`` list."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"opd prune: {type(model).__name__}'s decoder has no 'layers' list to prune")
    for name, module in model.named_modules():
        if module is layers:
            return name, layers
    raise AssertionError("the decoder's layers are a submodule of the model")


@torch.no_grad()
def block_importance(model: PreTrainedModel, batches: Sequence[dict[str, torch.Tensor]]) -> list[float]:
    """Each decoder layer's block importance, ``1 − cos(input, output)`` averaged over ``attention_mask`` tokens."""
    _, layers = decoder_layers(model)
    sums = torch.zeros(len(layers), dtype=torch.float64)
    tokens = 0
    mask: torch.Tensor | None = None

    def hook_for(index: int) -> Any:
        def record(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            inputs = args[0] if args else kwargs["hidden_states"]
            outputs = output[0] if isinstance(output, tuple) else output
            cosine = torch.nn.functional.cosine_similarity(inputs.double(), outputs.double(), dim=-1)
            assert mask is not None
            sums[index] += ((1.0 - cosine) * mask).sum().item()

        return record

    handles = [layer.register_forward_hook(hook_for(index), with_kwargs=True) for index, layer in enumerate(layers)]
    try:
        for batch in batches:
            mask = batch["attention_mask"].double()
            tokens += int(batch["attention_mask"].sum())
            model(**batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise ConfigError("opd prune: the calibration text has no tokens")
    return (sums / tokens).tolist()


def pruned_config(config: PretrainedConfig, keep: Sequence[int]) -> PretrainedConfig:
    """``config`` with ``len(keep)`` layers; every per-layer list keeps the kept layers' entries."""
    total = config.num_hidden_layers
    pruned = copy.deepcopy(config)
    for name, value in vars(config).items():
        # Token ids are never per layer, even when a list of them happens to be as long as the model is deep.
        not_per_layer = name == "architectures" or name.endswith(("token_id", "token_ids"))
        if isinstance(value, (list, tuple)) and len(value) == total and not not_per_layer:
            setattr(pruned, name, type(value)(value[index] for index in keep))
    pruned.num_hidden_layers = len(keep)
    return pruned


def prune_depth(model: PreTrainedModel, keep: Sequence[int]) -> PreTrainedModel:
    """A new model (CPU, ``model``'s dtype) holding only the decoder layers ``keep``, in that order.

    Raises:
        ConfigError: ``keep`` is empty, repeats a layer or names one the model lacks.
    """
    from transformers import AutoModelForCausalLM

    prefix, layers = decoder_layers(model)
    if not keep or len(set(keep)) != len(keep) or not all(0 <= index < len(layers) for index in keep):
        raise ConfigError(f"opd prune: layers to keep must be distinct indices below {len(layers)}, got {list(keep)}")
    pruned = AutoModelForCausalLM.from_config(pruned_config(model.config, keep), dtype=model.dtype)
    new_index = {old: new for new, old in enumerate(keep)}
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = pattern.match(name)
        if match is None:
            state[name] = tensor
        elif int(match.group(1)) in new_index:
            state[f"{prefix}.{new_index[int(match.group(1))]}.{match.group(2)}"] = tensor
    pruned.load_state_dict(state)
    pruned.generation_config = copy.deepcopy(model.generation_config)
    return pruned.eval()


@dataclass(frozen=True)
class PruningPlan:
    """What ``opd prune`` keeps, and why: written to :data:`PRUNING_RECORD` beside the model."""

    source: str
    source_layers: int
    kept_layers: list[int]
    method: str
    importance: list[float] | None = None
    calibration: str | None = None
    calibration_examples: int = 0


def calibration_batches(
    tokenizer: Any, texts: Sequence[str], max_tokens: int, batch_size: int = 4
) -> list[dict[str, torch.Tensor]]:
    """``texts`` tokenised (cut to ``max_tokens``) and right-padded into batches of ``batch_size``."""
    batches = []
    for begin in range(0, len(texts), batch_size):
        encoded = tokenizer(
            list(texts[begin : begin + batch_size]),
            add_special_tokens=False,
            truncation=True,
            max_length=max_tokens,
            padding=True,
            return_tensors="pt",
        )
        batches.append({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    return batches


def write_pruned_model(
    model: PreTrainedModel, tokenizer: Any, plan: PruningPlan, output: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Prunes ``model`` as ``plan`` says and writes it, its tokenizer and the plan to ``output``.

    The directory appears under its final name only when complete; ConfigError if it exists.
    """
    output = Path(output)
    _refuse_existing(output)
    staging = output.with_name(f".tmp_{output.name}")
    if staging.exists():
        shutil.rmtree(staging)
    pruned = prune_depth(model, plan.kept_layers)
    if dtype is not None:
        # torch's own method: transformers types its .to() so that mypy rejects a dtype argument.
        torch.nn.Module.to(pruned, dtype)
    pruned.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    (staging / PRUNING_RECORD).write_text(json.dumps(asdict(plan), indent=1) + "\n")
    staging.rename(output)
    return output


def _refuse_existing(output: Path) -> None:
    if output.exists():
        raise ConfigError(f"opd prune: {output} exists already; choose a new directory")


def prune_source(
    source: str,
    output: str | Path,
    layers: int | None = None,
    method: str = "even",
    keep: Sequence[int] | None = None,
    calibration: str | None = None,
    calibration_examples: int = 64,
    max_tokens: int = 512,
    dtype: torch.dtype = torch.float32,
) -> tuple[Path, PruningPlan]:
    """``opd prune``: loads ``source`` (a model directory, a GGUF file or ``tiny:``), prunes it and writes it.

    Args:
        layers: how many decoder layers to keep (with ``method``), or None with ``keep``.
        keep: the layer indices to keep, instead of ``layers`` and ``method``.
        calibration: chat examples whose whole rendered conversations measure importance.
        calibration_examples: the first this many examples are used; each cut to ``max_tokens``.

    Raises:
        ConfigError: a bad combination of options, or a model or dataset that cannot be read.
    """
    from opd.data.datasets import load_chat_dataset
    from opd.data.sequences import render_chat
    from opd.models.config import ModelLoadingConfig
    from opd.models.loading import load_causal_lm, load_tokenizer

    if (layers is None) == (keep is None):
        raise ConfigError("opd prune: give either --layers (with --method) or --keep")
    if method not in LAYER_CHOICES:
        raise ConfigError(f"opd prune: --method must be one of {', '.join(LAYER_CHOICES)}, got {method!r}")
    measured = keep is None and method == "importance"
    if measured and calibration is None:
        raise ConfigError("opd prune: --method importance measures layers on text: give --calibration DATA.jsonl")
    # The output and the data are checked before the model's slow load.
    _refuse_existing(Path(output))
    conversations = None
    if measured:
        conversations = load_chat_dataset(str(calibration), max_examples=calibration_examples)
    # A base model's tokenizer may have no chat template: only calibration chats need one.
    tokenizer = load_tokenizer(source, require_chat_template=conversations is not None)
    model = load_causal_lm(source, dtype, torch.device("cpu"), ModelLoadingConfig())
    total = len(decoder_layers(model)[1])
    importance: list[float] | None = None
    examples = 0
    if keep is not None:
        chosen, how = sorted(keep), "given"
    elif not measured:  # even
        assert layers is not None
        chosen, how = evenly_spaced_layers(total, layers), method
    else:
        assert layers is not None and conversations is not None
        texts = [render_chat(tokenizer, example["messages"], add_generation_prompt=False) for example in conversations]
        examples = len(texts)
        importance = block_importance(model, calibration_batches(tokenizer, texts, max_tokens))
        chosen, how = most_important_layers(importance, layers), method
    plan = PruningPlan(source, total, chosen, how, importance, calibration, examples)
    return write_pruned_model(model, tokenizer, plan, output, dtype), plan
