"""LoRA students through ``peft``: wrapping, the adapter's state, merged weights.

:func:`wrap_with_lora` injects adapters into the student *in place* (peft replaces each
targeted ``nn.Linear`` by a ``lora.Linear`` holding the frozen base layer and the
trainable ``lora_A`` / ``lora_B``). Every holder of the student module — the policy's
forward, the fused LM-head path, the in-process generation engine — therefore runs with
the current adapter without knowing about peft. Only the adapter's parameters keep
``requires_grad``.

A separate engine (vLLM) and ``final_model/`` need a plain model instead:
:func:`merged_tensors` maps the wrapped model's tensors back to the base model's names,
with ``W + (alpha / r)·B·A`` for every adapted weight, computed as peft's own
``merge_and_unload`` does but without touching the module (an in-place merge and unmerge
would not restore the base weights bit for bit, and exact resume needs them).

The adapters start from :func:`initialise_adapters`: ``lora_B`` zero, ``lora_A`` drawn
as peft draws it but from a generator seeded by the run's seed and the tensor's name, so
an in-process student and the FSDP2 ranks of a cluster (each holding a shard, built
after its own model loading) start from the same adapter. The same functions work on
a model sharded with FSDP2: its parameters are DTensors, and :func:`merged_tensors`
then yields merged DTensors sharded as the base weights are.
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
    """The ``peft`` module.

    Raises:
        ConfigError: if peft is not installed, saying how to install it.
    """
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs the peft package: pip install 'opd[lora]'") from None
    return peft


def wrap_with_lora(model: PreTrainedModel, config: LoraConfig) -> Any:
    """Injects LoRA adapters into ``model`` (in place) and freezes everything else.

    Returns:
        The ``peft.PeftModel`` around ``model`` (for saving the adapter); ``model`` itself
        now computes with the adapters.

    Raises:
        ConfigError: peft missing, no module matching ``model.lora.target_modules``, or an
            adapter on the embedding or output layer.
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

    ``lora_B`` is zero (the student starts as its base model); ``lora_A`` is drawn from
    peft's own distribution (Kaiming-uniform with ``a = √5``) by a generator seeded from
    ``seed`` and the parameter's name. Every process therefore draws the same values for
    the same name, whatever it loaded or drew before: a sharded parameter (an FSDP2
    DTensor) takes its own rows of the whole draw.

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
    """What :func:`merged_tensors` yields, by name, shape and dtype, without computing any merge.

    The base layer's tensors stand for the merged ones (the same shape and dtype): for
    describing what a refit will send, where the merge's collectives (on a sharded model)
    must not run.
    """
    lora_layer = import_peft().tuners.lora.LoraLayer
    adapted = {name: module for name, module in model.named_modules() if isinstance(module, lora_layer)}
    for name, tensor in tensors:
        owner, _, leaf = name.rpartition(".")
        layer_name = _adapted_ancestor(owner, adapted)
        if layer_name is None:
            yield name, tensor
        elif owner == layer_name + _BASE_LAYER:
            yield f"{layer_name}.{leaf}", tensor


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
    """``tensors`` of a LoRA-wrapped ``model`` as the plain base model names and holds them.

    Adapter tensors are dropped; ``<layer>.base_layer.<name>`` becomes ``<layer>.<name>``,
    and an adapted layer's weight becomes ``W + ΔW`` in ``W``'s dtype (what peft's
    merge writes). Everything else passes through detached.

    On a model sharded with FSDP2 the tensors are DTensors: ``ΔW = B·A`` is then a
    DTensor product, sharded as ``W`` (every rank must iterate to the end, in the same
    order: the product gathers the small ``A``).

    Args:
        model: the wrapped model (to find each adapted layer).
        tensors: ``(name, tensor)`` pairs of ``model``, e.g. ``named_parameters()`` or
            ``state_dict().items()``.
    """
    lora_layer = import_peft().tuners.lora.LoraLayer
    adapted = {name: module for name, module in model.named_modules() if isinstance(module, lora_layer)}
    for name, tensor in tensors:
        owner, _, leaf = name.rpartition(".")
        layer_name = _adapted_ancestor(owner, adapted)
        if layer_name is None:
            yield name, tensor.detach()
        elif owner == layer_name + _BASE_LAYER:
            value = tensor.detach()
            if leaf == "weight":
                with torch.no_grad():  # the adapter's parameters require grad
                    value = (value + adapted[layer_name].get_delta_weight(ADAPTER_NAME)).to(value.dtype)
            yield f"{layer_name}.{leaf}", value
        # else: lora_A / lora_B of an adapted layer, which the merged weight already holds


def _adapted_ancestor(module_name: str, adapted: dict[str, Any]) -> str | None:
    """The adapted layer that ``module_name`` is or lies inside, if any (walking up the dotted path)."""
    parts = module_name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in adapted:
            return candidate
    return None
