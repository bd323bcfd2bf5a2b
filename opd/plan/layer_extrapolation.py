"""A dry run of a few decoder layers, extrapolated to the model's real depth.

Alike decoder layers hold, gather and leave behind the same memory, so at a given point of a step every tracked
figure is affine in the depth, ``a + b · depth``: traces at 3 and 4 layers give it at 28 or 64 without tracing them.
The peak is not affine (which point holds it can change with depth), so it is kept per **phase** (:class:`PhasePeaks`):
a stretch with the same shape at every depth (inside the first, a middle or the last layer, forward or backward, of a
given micro-batch, or the ops between such stretches). A phase's peak is at one of its ends, so it is affine; the
step's peak is the largest extrapolated phase peak (:func:`extrapolate`). Only models of alike layers
(:func:`uniform_depth`) are extrapolated; the result equals a full-depth trace byte for byte.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

BASE_DEPTH = 3
"""The shallower of the two traced depths: the first, one middle and the last layer each exist."""

UNIFORM_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""Model types whose decoder layers are all alike, given one attention kind (see :func:`uniform_depth`)."""

Phase = tuple[Any, ...]
"""A phase of the step: a micro-batch count and where in the step (see the module docstring)."""

Snapshot = dict[str, int]
"""The tracker's bytes by category on one device, with ``Total``."""


def uniform_depth(config: Any) -> int | None:
    """The layer count of a model whose layers are all alike, else None.

    Alike: a type in :data:`UNIFORM_MODEL_TYPES` with one attention kind in ``layer_types`` (not dense and MoE, or
    full and sliding-window, interleaved).
    """
    if getattr(config, "model_type", None) not in UNIFORM_MODEL_TYPES:
        return None
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return None
    return depth


def with_depth(config: Any, depth: int) -> Any:
    """A copy of ``config`` with ``depth`` layers (the first ``depth`` of its ``layer_types``)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:depth])
    return config


def extrapolated_depths(depths: Mapping[str, int]) -> dict[str, int]:
    """The full depths by path worth extrapolating: deeper than ``BASE_DEPTH + 1`` (else a whole trace is as cheap)."""
    return {path: depth for path, depth in depths.items() if depth > BASE_DEPTH + 1}


def decoder_layers(model: nn.Module, depth: int) -> Sequence[nn.Module]:
    """The model's ``layers`` list of ``depth`` modules under any wrapper (FSDP2, peft); empty if it has none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module) == depth:
            return list(module)
    return []


class PhasePeaks:
    """Keeps a ``MemTracker``'s (or ``FSDPMemTracker``'s) largest snapshot per phase and device; attach before entering.

    ``models`` maps a name to (model, its decoder layers); each forward of ``micro_batch_root`` starts a micro-batch.
    """

    def __init__(
        self,
        tracker: Any,
        models: Mapping[str, tuple[nn.Module, Sequence[nn.Module]]],
        micro_batch_root: nn.Module | None,
    ) -> None:
        self._tracker = tracker
        self._layers: dict[str, tuple[str, str, int]] = {}
        modules = tracker._mod_tracker
        for model, (root, layers) in models.items():
            # Named and marked seen up front; else the tracker names modules by class, a student and teacher alike.
            for path, module in root.named_modules():
                modules._known_modules[module] = f"opd.{model}.{path}" if path else f"opd.{model}"
                modules._seen_modules.add(module)
            for index, layer in enumerate(layers):
                position = "first" if index == 0 else "last" if index == len(layers) - 1 else "middle"
                self._layers[modules._known_modules[layer]] = (model, position, index)
        self._micro_batches = 0
        self._after: Phase = ("start",)
        self.peaks: dict[Phase, dict[str, Snapshot]] = {}
        if micro_batch_root is not None:
            micro_batch_root.register_forward_pre_hook(self._next_micro_batch, prepend=True)
        counted = tracker._update_peak_stats

        def update_peak_stats(peak_state: Any) -> None:
            counted(peak_state)
            self.record()

        tracker._update_peak_stats = update_peak_stats

    def _next_micro_batch(self, *_: Any) -> None:
        self._micro_batches += 1

    def _phase(self) -> Phase:
        tracker = self._tracker._mod_tracker
        active = [self._layers[name] for name in tracker.parents if name in self._layers]
        if not active:
            return (self._micro_batches, "after", *self._after)
        backward = tracker.is_bw
        # Two layers are active together only at a hand-over; the one entered names the phase.
        entered = min if backward else max
        model, position, _ = entered(active, key=lambda layer: layer[2])
        self._after = (model, "backward" if backward else "forward", position)
        return (self._micro_batches, "in", *self._after)

    def record(self) -> None:
        """Keeps the tracker's current snapshot if it is its phase's largest so far (per device)."""
        phase = self._phase()
        kept = self.peaks.setdefault(phase, {})
        for device, snapshot in self._tracker._curr_mem_snap.items():
            key = device.type
            total = snapshot.get("Total", 0)
            if key not in kept or kept[key]["Total"] < total:
                kept[key] = {str(getattr(kind, "value", kind)): int(value) for kind, value in snapshot.items()}


def largest_phase_peak(peaks: Mapping[Phase, Mapping[str, Snapshot]]) -> dict[str, Snapshot]:
    """Per device, the snapshot of the phase whose ``Total`` is the largest (the first such phase on a tie)."""
    best: dict[str, Snapshot] = {}
    for per_device in peaks.values():
        for device, snapshot in per_device.items():
            if device not in best or best[device]["Total"] < snapshot["Total"]:
                best[device] = dict(snapshot)
    return best


@dataclass
class Trace:
    """One dry run's scalars (bytes, counts), phase peaks, and ``extrapolated`` models (path → depth reached)."""

    scalars: dict[str, int]
    peaks: dict[Phase, dict[str, Snapshot]] = field(default_factory=dict)
    extrapolated: dict[str, int] = field(default_factory=dict)


def extrapolate(base: Trace, deeper: Mapping[str, Trace], steps: Mapping[str, int]) -> Trace | None:
    """The figures at full depth: ``base + Σ (deeper[path] − base) · steps[path]``, per phase and category.

    ``steps[path]`` is the layers beyond the base depth. None when the traces' phases differ (trace it whole).
    """
    if any(trace.peaks.keys() != base.peaks.keys() for trace in deeper.values()):
        return None
    traces = [base, *deeper.values()]
    deeper_steps = [steps[path] for path in deeper]

    def affine(values: list[int]) -> int:
        """``values``: a figure of the base trace, then of each deeper trace."""
        start, *one_deeper = values
        return start + sum((value - start) * step for value, step in zip(one_deeper, deeper_steps, strict=True))

    scalars = {name: affine([trace.scalars.get(name, 0) for trace in traces]) for name in base.scalars}
    peaks: dict[Phase, dict[str, Snapshot]] = {}
    for phase in base.peaks:
        per_trace = [trace.peaks[phase] for trace in traces]
        peaks[phase] = {}
        # Devices and kinds in the base trace's order, as a full trace lists them.
        for device in dict.fromkeys(device for per_device in per_trace for device in per_device):
            snapshots = [per_device.get(device, {}) for per_device in per_trace]
            kinds = dict.fromkeys(kind for snapshot in snapshots for kind in snapshot)
            peaks[phase][device] = {kind: affine([snapshot.get(kind, 0) for snapshot in snapshots]) for kind in kinds}
    return Trace(scalars, peaks, {path: BASE_DEPTH + step for path, step in steps.items()})
