"""What one dry-run step (:mod:`opd.plan.dry_run`) runs under, and how its trace is read.

Models are built from their configs without weights (:func:`skeleton`), possibly cut in depth (:data:`LAYER_DEPTHS`);
:func:`fake_step` enters every fake mode at once; :func:`traced_or_extrapolated` gives the figures at real depth.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from transformers import AutoModelForCausalLM

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.fsdp import HIDDEN_STATES_METHOD
from opd.models.lm_head import OutputLayer, final_hidden_states, output_layer_of
from opd.models.model_shapes import model_config
from opd.plan.fake_device import (
    DataDependentStandIns,
    DeviceAudit,
    attributes_replaced,
    fake_process_group,
    gpu_attention,
    sharding_metadata_apart,
    tensors_from_data_via_host,
)
from opd.plan.layer_extrapolation import (
    BASE_DEPTH,
    Phase,
    PhasePeaks,
    Snapshot,
    Trace,
    decoder_layers,
    extrapolate,
    extrapolated_depths,
    largest_phase_peak,
    uniform_depth,
    with_depth,
)

LAYER_DEPTHS: dict[str, int] = {}
"""Model paths built with fewer layers than their config has, during one trace (:func:`traced_or_extrapolated`)."""


def skeleton(path: str, dtype: torch.dtype, depth: int | None = None) -> Any:
    """The model at ``path`` built from its config alone, on the meta device.

    ``depth`` (else :data:`LAYER_DEPTHS`'s) cuts a model of alike layers to that many decoder layers.
    """
    config = model_config(path)
    depth = depth or LAYER_DEPTHS.get(path)
    if depth is not None and uniform_depth(config) is not None:
        config = with_depth(config, depth)
    with unset_fake_temporarily(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _models_from_their_configs() -> contextlib.AbstractContextManager[None]:
    """The trainer's model loading (``load_sharded`` and the rest) on fake storage, the weight files never read."""
    from opd.distributed import trainer_worker

    def sharded(
        path: str, dtype: torch.dtype, device: torch.device, loading: Any, shard: Any, added: Any = None
    ) -> Any:
        model = shard(skeleton(path, dtype))
        model.to_empty(device=device)
        if added is not None:  # a LoRA student's adapters
            added(model)
        return model

    def whole(path: str, dtype: torch.dtype, device: torch.device, config: Any, device_map: str | None = None) -> Any:
        model = skeleton(path, dtype)
        model.to_empty(device=device)
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()  # to_empty gave the tied head a tensor of its own
        return model

    def head(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False) -> OutputLayer:
        # The output layer is the same at any depth: one decoder layer suffices.
        layer = output_layer_of(skeleton(path, dtype, depth=1), path)
        bias = None if layer.bias is None else torch.empty_like(layer.bias, device=device)
        return replace(layer, weight=torch.empty_like(layer.weight, device=device), bias=bias)

    wrap_with_lora = trainer_worker.wrap_with_lora

    def lora_on_meta(model: Any, config: Any) -> Any:
        # peft would move the adapters to the base layer's device, which a fake tensor refuses; on meta, no move.
        with unset_fake_temporarily(), torch.device("meta"):
            return wrap_with_lora(model, config)

    return attributes_replaced(
        trainer_worker, load_sharded=sharded, load_causal_lm=whole, load_output_layer=head, wrap_with_lora=lora_on_meta
    )


def hidden_states_as_module_call(model: Any) -> None:
    """Routes ``model.opd_hidden_states`` through ``model.__call__``, whose hooks FSDPMemTracker wraps.

    FSDP2 runs a registered method's pre- and post-forward steps directly, where the tracker would not see them.
    """

    def as_call(
        input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        model.forward = functools.partial(final_hidden_states, model)
        try:
            return model(input_ids, attention_mask, position_ids)
        finally:
            del model.forward

    setattr(model, HIDDEN_STATES_METHOD, as_call)


@dataclass(frozen=True)
class StepShape:
    """The micro-batches of one dry-run step on one rank; ``response_tokens`` per row carry loss."""

    micro_batch_size: int
    prompt_tokens: int
    response_tokens: int
    micro_batches: int = 1

    @property
    def row_tokens(self) -> int:
        """Positions of one row: prompt and response."""
        return self.prompt_tokens + self.response_tokens


def local_tensor(tensor: Any) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (a DTensor counts its local shard)."""
    storages = (local_tensor(tensor).untyped_storage() for tensor in tensors if tensor is not None)
    return sum({id(storage): storage.nbytes() for storage in storages}.values())


def planned_micro_batch(shape: StepShape, vocab_size: int) -> BatchedDataDict:
    """A right-padded micro-batch of full rows: the prompt, then the response that carries loss."""
    rows, length = shape.micro_batch_size, shape.row_tokens
    token_mask = torch.zeros(rows, length, dtype=torch.long)
    token_mask[:, shape.prompt_tokens :] = 1
    return BatchedDataDict(
        {
            "input_ids": torch.randint(0, vocab_size, (rows, length)),
            "input_lengths": torch.full((rows,), length),
            "prompt_lengths": torch.full((rows,), shape.prompt_tokens),
            "token_mask": token_mask,
            "generation_logprobs": torch.zeros(rows, length),
        }
    )


@contextlib.contextmanager
def fake_step(
    rank: int, world_size: int, shard_group_size: int | None, shape: StepShape, audit: DeviceAudit
) -> Iterator[Any]:
    """Everything a dry-run step runs under (see :mod:`opd.plan.dry_run`); yields the process group's mesh."""
    with (
        fake_process_group(rank, world_size, shard_group_size) as mesh,
        FakeTensorMode(allow_non_fake_inputs=True),
        tensors_from_data_via_host(),
        attributes_replaced(torch.nn.functional, scaled_dot_product_attention=gpu_attention),
        sharding_metadata_apart(),
        _models_from_their_configs(),
        DataDependentStandIns(shape.response_tokens),
        audit,
    ):
        yield mesh


def traced_or_extrapolated(trace: Callable[[], Trace], paths: Sequence[str], every_layer: bool) -> Trace:
    """The step's figures at the models' real depths: traced whole, or extrapolated from shallow traces.

    ``trace()`` runs the dry run, with :data:`LAYER_DEPTHS` set for it. Each model that qualifies
    (:func:`~opd.plan.layer_extrapolation.extrapolated_depths`) is traced at ``BASE_DEPTH`` and one deeper.
    """

    def trace_at(depths: dict[str, int]) -> Trace:
        LAYER_DEPTHS.update(depths)
        try:
            return trace()
        finally:
            LAYER_DEPTHS.clear()

    depths = {path: uniform_depth(model_config(path)) for path in dict.fromkeys(paths)}
    full_depths = {path: depth for path, depth in depths.items() if depth is not None}
    varied = {} if every_layer else extrapolated_depths(full_depths)
    if varied:
        base_depths = dict.fromkeys(varied, BASE_DEPTH)
        base = trace_at(base_depths)
        deeper = {path: trace_at({**base_depths, path: BASE_DEPTH + 1}) for path in varied}
        extrapolated = extrapolate(base, deeper, {path: depth - BASE_DEPTH for path, depth in varied.items()})
        if extrapolated is not None:
            return extrapolated
    return trace_at({})


def phase_peaks(tracker: Any, models: dict[str, Any], micro_batch_root: Any) -> PhasePeaks:
    """A :class:`PhasePeaks` over these models' decoder layers; a model cut to fewer layers must have them."""
    layers = {}
    for name, (path, model) in models.items():
        found = decoder_layers(model, model.config.num_hidden_layers)
        if not found and path in LAYER_DEPTHS:
            raise ValueError(f"the dry run cut {path} to {LAYER_DEPTHS[path]} layers but finds no list of them")
        layers[name] = (model, found)
    return PhasePeaks(tracker, layers, micro_batch_root)


def check_phase_peaks(phases: PhasePeaks, tracker: Any) -> None:
    """The largest phase peak is the tracker's own peak on every device: no op went unrecorded."""
    own = {dev.type: int(values.get("Total", 0)) for dev, values in tracker.get_tracker_snapshot("peak").items()}
    kept = {kind: snapshot["Total"] for kind, snapshot in largest_phase_peak(phases.peaks).items()}
    if own != kept:
        raise RuntimeError(f"the dry run's phase peaks {kept} are not the memory tracker's peaks {own}")


def peak_on(peaks: dict[Phase, dict[str, Snapshot]], device: torch.device) -> tuple[int, Snapshot]:
    """From a trace's phase peaks: the host's peak bytes (the other devices' peaks, summed), the compute device's."""
    peak = largest_phase_peak(peaks)
    host = sum(snapshot.get("Total", 0) for kind, snapshot in peak.items() if kind != device.type)
    return host, peak.get(device.type, {})
