"""LoRA students through ``peft``: wrapping, the adapter's state, merged weights.

:func:`wrap_with_lora` injects adapters *in place*, so every holder of the student module runs with the current
adapter without knowing about peft; only adapter parameters keep ``requires_grad``.

A separate engine (vLLM) and ``final_model/`` need a plain model: :func:`merged_tensors` yields base-model names
with ``W + (alpha / r)·B·A``, computed without touching the module (an in-place merge and unmerge would not restore
the base weights bit for bit, and exact resume needs them). All functions also work on FSDP2 DTensors.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from opd.models.config import LoraConfig
from opd.utils.errors import ConfigError, OpdError

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

ADAPTER_NAME = "default"
"""The one adapter a student holds (peft's default name)."""

_BASE_LAYER = ".base_layer"


def import_peft() -> Any:
    """The ``peft`` module; ConfigError saying how to install it if missing."""
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs the peft package: pip install 'opd[lora]'") from None
    return peft


def wrap_with_lora(model: PreTrainedModel, config: LoraConfig) -> Any:
    """Injects LoRA adapters into ``model`` (in place) and freezes everything else.

    Returns the ``peft.PeftModel`` around ``model`` (for saving the adapter).

    Raises:
        ConfigError: peft missing, no module matching ``target_modules``, or an adapter on an embedding layer.
    """
    peft = import_peft()
    peft_config = peft.LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=config.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = peft.get_peft_model(model, peft_config, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # peft's "Target modules ... not found in the base model"
        raise ConfigError(f"model.lora.target_modules = {config.target_modules!r}: {error}") from None
    lora_layer = peft.tuners.lora.LoraLayer
    for layer, role in ((model.get_input_embeddings(), "input embedding"), (model.get_output_embeddings(), "output")):
        if isinstance(layer, lora_layer):
            raise ConfigError(
                f"model.lora.target_modules = {config.target_modules!r} puts an adapter on the {role} layer, which "
                "the fused loss and the merged refit read directly; name the decoder's projections instead"
            )
    return wrapped


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable (adapter) parameters of a wrapped model, by their names in ``model``."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def initialise_adapters(model: torch.nn.Module, seed: int) -> set[str]:
    """Sets every adapter of a wrapped ``model`` to its start and returns the adapters' parameter names.

    ``lora_B`` is zero; ``lora_A`` is peft's Kaiming-uniform (``a = √5``) from a generator seeded by ``seed`` and
    the parameter's name, so every process and FSDP2 shard draws the same adapter.

    Raises:
        OpdError: a trainable parameter that is neither ``lora_A`` nor ``lora_B``.
    """
    names = set()
    with torch.no_grad():
        for name, param in adapter_parameters(model).items():
            if ".lora_A." not in name and ".lora_B." not in name:
                raise OpdError(f"the LoRA student has a trainable parameter {name} that is not an adapter's")
            whole = torch.zeros(param.shape, dtype=torch.float32)
            if ".lora_A." in name:
                generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
                torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            _copy_own_part(param, whole)
            names.add(name)
    return names


def _copy_own_part(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copies ``whole`` into ``param``, or into its local shard when ``param`` is a DTensor (no collective)."""
    if not isinstance(param, DTensor):
        param.copy_(whole)
        return
    local = param.to_local()
    if local.numel() == 0:  # a rank past the last row of an uneven split
        return
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local.copy_(whole[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))])


def plain_entries(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """What :func:`merged_tensors` yields, by name, shape and dtype, without the merge or its collectives."""
    return ((name, tensor) for name, tensor, _ in _base_model_entries(model, tensors))


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copies saved adapter tensors into ``model``'s adapter parameters (exact copies).

    Raises:
        OpdError: if the saved adapter does not fit (another rank, other target modules).
    """
    params = adapter_parameters(model)
    if set(state) != set(params):
        missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise OpdError(
            "the checkpoint's LoRA adapter does not match model.lora "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); resume with the run's own model.lora settings"
        )
    with torch.no_grad():
        for name, param in params.items():
            if state[name].shape != param.shape:
                raise OpdError(
                    f"the checkpoint's LoRA tensor {name} has shape {tuple(state[name].shape)}, model.lora gives "
                    f"{tuple(param.shape)}; resume with the run's own model.lora.r"
                )
            param.copy_(state[name])


def merged_tensors(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a LoRA-wrapped ``model`` as the plain base model names and holds them.

    Adapter tensors are dropped, ``<layer>.base_layer.<name>`` becomes ``<layer>.<name>``, and an adapted weight
    becomes ``W + ΔW`` in ``W``'s dtype; the rest passes through detached. On FSDP2 every rank must iterate to
    the end in the same order (the DTensor product gathers ``A``).
    """
    for name, tensor, adapted_layer in _base_model_entries(model, tensors):
        value = tensor.detach()
        if adapted_layer is not None:
            with torch.no_grad():  # the adapter's parameters require grad
                value = (value + adapted_layer.get_delta_weight(ADAPTER_NAME)).to(value.dtype)
        yield name, value


def _base_model_entries(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """``(base-model name, tensor, the adapted layer whose delta its weight takes or None)``, adapters dropped."""
    lora_layer = import_peft().tuners.lora.LoraLayer
    adapted = {name: module for name, module in model.named_modules() if isinstance(module, lora_layer)}
    for name, tensor in tensors:
        owner, _, leaf = name.rpartition(".")
        layer_name = _adapted_ancestor(owner, adapted)
        if layer_name is None:
            yield name, tensor, None
        elif owner == layer_name + _BASE_LAYER:
            yield f"{layer_name}.{leaf}", tensor, adapted[layer_name] if leaf == "weight" else None
        # else: lora_A / lora_B of an adapted layer, which the merged weight already holds


def _adapted_ancestor(module_name: str, adapted: dict[str, Any]) -> str | None:
    """The adapted layer that ``module_name`` is or lies inside, if any (walking up the dotted path)."""
    parts = module_name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in adapted:
            return candidate
    return None
