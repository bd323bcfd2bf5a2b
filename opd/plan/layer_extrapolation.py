"""A dry run of a few decoder layers, extrapolated to the model's real depth.

The layers of a decoder are alike: each holds the same shards, gathers the same weights
and leaves the same activations behind. At a given point of a step (say, the last op of
the last layer's forward in the second micro-batch) every figure the memory tracker keeps
is therefore an affine function of the number of layers: ``a + b · depth``. A dry run of a
3- and a 4-layer copy of the model fixes ``a`` and ``b``, and gives the figure at 28 or 64
layers without tracing them, which is most of a dry run's time.

The peak itself is not affine: it is the largest of these figures over the whole step, and
which point of the step holds it can change with depth (a deep student's activations
overtake a teacher's gathered layer). So the step is cut into **phases**, and the peak
is kept per phase (:class:`PhasePeaks`). A phase is a stretch of the step that has the
same shape at every depth: inside the first, a middle or the last layer of a model, in the
forward or the backward, of a given micro-batch, or the ops after one such stretch and
before the next (the embedding, the final norm, the loss, the optimizer step). Within a
phase, memory grows or shrinks by the same amount from one layer to the next, so its peak
is at one of its ends and is affine in the depth; the step's peak is the largest of the
phases' extrapolated peaks (:func:`extrapolate`).

Extrapolation is used only where the layers really are alike: a model type whose layers
opd knows to be uniform, with one kind of attention over all layers
(:func:`uniform_depth`). Anything else is traced at its full depth. The test suite checks
the extrapolated figures against full-depth traces, byte for byte
(``tests/distributed/test_layer_extrapolation.py``).
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
    """The model's layer count when its layers are all alike, so that its dry run can be extrapolated; else None.

    Alike means a model type in :data:`UNIFORM_MODEL_TYPES` with one attention kind over
    every layer (``layer_types``). A model with dense and mixture-of-experts layers, or
    with full and sliding-window attention interleaved, is traced at full depth.
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
    """Of ``depths`` (a model path's full depth, for the paths with alike layers), those worth extrapolating.

    A model of at most ``BASE_DEPTH + 1`` layers costs no more traced whole.
    """
    return {path: depth for path, depth in depths.items() if depth > BASE_DEPTH + 1}


def decoder_layers(model: nn.Module, depth: int) -> Sequence[nn.Module]:
    """The model's decoder layers: its ``layers`` list of ``depth`` modules (under any wrapper: FSDP2, peft).

    Empty when the model keeps its layers otherwise (such a model is traced whole).
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(module) == depth:
            return list(module)
    return []


class PhasePeaks:
    """Keeps a memory tracker's peak per phase of the step (see the module docstring).

    Attached to a ``torch.distributed._tools`` ``MemTracker`` (or ``FSDPMemTracker``)
    before it is entered: it names each decoder layer for the tracker's module tracker and
    records, after every op the tracker counts, the current snapshot under the phase it
    belongs to, keeping the largest per phase and device.

    Args:
        tracker: the memory tracker.
        models: each model's name, and the model with its decoder layers.
        micro_batch_root: the module whose every forward starts a micro-batch (the student).
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
            # Every module is named up front, and marked as seen so that the module tracker
            # keeps the names: it would otherwise name a model by its class, and a student
            # and a teacher of one architecture alike.
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
        # Two neighbouring layers are active together only at the hand-over from one to
        # the next; the one being entered names the phase (the lower one in the backward).
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

    def peak(self) -> dict[str, Snapshot]:
        """The step's peak per device: the largest phase peak."""
        return largest_phase_peak(self.peaks)


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
    """One dry run's figures: its scalars (bytes, counts) and its phase peaks.

    ``extrapolated`` names the models whose figures were extrapolated (path → the depth
    reached); empty for a trace of every layer.
    """

    scalars: dict[str, int]
    peaks: dict[Phase, dict[str, Snapshot]] = field(default_factory=dict)
    extrapolated: dict[str, int] = field(default_factory=dict)


def extrapolate(base: Trace, deeper: Mapping[str, Trace], steps: Mapping[str, int]) -> Trace | None:
    """The figures at full depth from a base trace and one trace one layer deeper per model path.

    Each figure is ``base + Σ (deeper[path] − base) · steps[path]``, where ``steps[path]``
    is the number of layers the path's model has beyond its base depth: exact when every
    figure is affine in every model's depth, as it is for alike layers. Phases are
    extrapolated one by one, each category of their snapshots alike.

    Returns None when the traces do not have the same phases (the step's shape changed
    with depth, so the model cannot be extrapolated: trace it whole).
    """
    if any(trace.peaks.keys() != base.peaks.keys() for trace in deeper.values()):
        return None

    def affine(start: int, one_deeper: Mapping[str, int]) -> int:
        return start + sum((value - start) * steps[path] for path, value in one_deeper.items())

    def bytes_of(trace: Trace, phase: Phase, device: str, kind: str) -> int:
        return trace.peaks[phase].get(device, {}).get(kind, 0)

    scalars = {
        name: affine(value, {path: trace.scalars.get(name, 0) for path, trace in deeper.items()})
        for name, value in base.scalars.items()
    }
    peaks: dict[Phase, dict[str, Snapshot]] = {}
    for phase, per_device in base.peaks.items():
        # In the base trace's order, so that a breakdown lists its kinds as a full trace does.
        devices = dict.fromkeys([*per_device, *(device for trace in deeper.values() for device in trace.peaks[phase])])
        peaks[phase] = {}
        for device in devices:
            kinds = dict.fromkeys(
                [
                    *per_device.get(device, {}),
                    *(kind for trace in deeper.values() for kind in trace.peaks[phase].get(device, {})),
                ]
            )
            peaks[phase][device] = {
                kind: affine(
                    bytes_of(base, phase, device, kind),
                    {path: bytes_of(trace, phase, device, kind) for path, trace in deeper.items()},
                )
                for kind in kinds
            }
    return Trace(scalars, peaks, {path: BASE_DEPTH + step for path, step in steps.items()})
