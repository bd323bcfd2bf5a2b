"""The trainer's real step at real shapes with no weights and no GPU: fake tensors over a fake process group.

:func:`dry_run_rank` runs one rank of the FSDP2 trainer the way a GPU cluster would:
:meth:`TrainerWorker.build <opd.distributed.trainer_worker.TrainerWorker.build>` shards
the student (and a colocated teacher) and builds the optimizer, and
:meth:`TrainerWorker.train <opd.distributed.trainer_worker.TrainerWorker.train>` runs
the configured loss over a micro-batch of the configured shape, forward, backward,
gradient reduction and optimizer step. Nothing is computed and nothing is allocated:

* every tensor is a ``FakeTensor`` (shape, dtype and device, no data), so a 32B teacher
  costs nothing; the models are built from their ``config.json`` on the meta device,
  sharded, and given fake storage on the compute device, as the trainer's sharded loading
  does before it reads the weights (:func:`opd.models.model_shapes.model_config`);
* the process group is ``torch.distributed``'s fake one (every collective returns at
  once), so rank ``r`` of ``N`` runs alone in this process;
* the compute device is a stand-in accelerator, ``fakegpu``: PyTorch's ``privateuseone``
  device type with a Python device guard and streams that do nothing. A CPU-only build
  cannot run even fake CUDA tensors through every operator (``copy_`` asks for a CUDA
  device guard, which only a CUDA build has), but any accelerator other than ``cpu``
  keeps host tensors apart from device tensors, which is what the audit needs. It is
  registered for the rest of the process (``torch.accelerator`` then reports it), so a
  dry run belongs in a process of its own, as ``opd plan`` runs it;
* ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` attributes every
  storage to parameters, gradients, optimizer state, activations and collective buffers
  and records the peak, as torchtitan's memory estimator does.

Two more things stand in for what fake tensors cannot do:

* **values.** A step reads a few values back to Python (a metric's ``float()``, a
  mask's selected positions). A read gives 1 (``True`` for a flag); a boolean selection
  over ``[..., L]`` positions picks each row's loss positions, that is the
  ``response_tokens`` a dry run plans for (the response is the part of a row that
  carries loss). Attention uses the flash kernel (its memory is linear in the length),
  as it does on a GPU.
* **the device audit.** Every tensor handed to a collective must live on the compute
  device: an NCCL process group has no CPU backend, so a host tensor there fails the
  first step on a GPU. :class:`DeviceMismatchError` names the collective, the device
  and the line of opd that called it.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.fsdp import HIDDEN_STATES_METHOD, device_mesh, shard_model
from opd.distributed.trainer_worker import ShardedTeacher, TrainerSpec, TrainerWorker
from opd.models.interfaces import (
    AnsweredWhereTrained,
    FullVocabRequest,
    LossFunction,
    TeacherHiddenStates,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.lm_head import OutputLayer, final_hidden_states, output_layer_of
from opd.models.model_shapes import model_config
from opd.plan.layer_extrapolation import (
    BASE_DEPTH,
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
from opd.teachers.local_teacher import LocalTeacher
from opd.utils.devices import is_cpu

ACCELERATOR = "fakegpu"
"""The stand-in compute device type: PyTorch's ``privateuseone`` under this name (see the module docstring)."""
_OPD_ROOT = Path(__file__).resolve().parents[1]
_aten = torch.ops.aten
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _tracked_kinds() -> Any:
    """FSDPMemTracker's categories plus the colocated teacher's weights (which it does not know of)."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import _RefType

    kinds = {kind.name: kind.value for kind in _FSDPRefType}
    kinds["TEACHER"] = "Teacher Param"
    return _RefType("_TrackedKinds", kinds)  # type: ignore[call-overload]


class DeviceMismatchError(RuntimeError):
    """A collective received a tensor that is not on the compute device (a bug in opd, found by the dry run)."""


# ---------------------------------------------------------------------------- the stand-in accelerator


class _NoStream:
    """A stream and event of the stand-in accelerator: there is nothing to order, every call is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:
        return _NoStream()

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


class _AcceleratorModule:
    """``torch.privateuseone``: the device-module API FSDP2 calls (one device, streams that do nothing)."""

    Stream = _NoStream
    Event = _NoStream

    def __init__(self) -> None:
        self._stream = _NoStream()

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def current_stream(self, device: Any = None) -> _NoStream:
        return self._stream

    # The random-number state, which activation checkpointing saves and restores around
    # its recomputation: there is none to keep.
    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass

    def device(self, device: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """What ``torch.autocast`` asks of a device (checkpointing's recomputation enters it)."""
        return [torch.float16, torch.bfloat16]

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


@functools.cache
def _register_accelerator() -> None:
    """Registers the stand-in accelerator once per process (PyTorch allows one registration)."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=ACCELERATOR, backend_module=_AcceleratorModule())


def compute_device() -> torch.device:
    """The dry run's compute device (the stand-in accelerator's device 0)."""
    _register_accelerator()
    return torch.device(ACCELERATOR, 0)


# ---------------------------------------------------------------------------- fake values and the audit


class _DataDependentStandIns(TorchDispatchMode):
    """Answers what a fake tensor cannot: values read back, data-dependent selections, the attention kernel.

    Args:
        response_tokens: loss positions per row: a boolean selection over ``[..., L]``
            picks this many positions of each row (all of them when ``L`` is shorter).
    """

    def __init__(self, response_tokens: int) -> None:
        super().__init__()
        self.response_tokens = response_tokens

    def _selected(self, mask: torch.Tensor) -> int:
        if mask.dim() == 0:
            return 1
        rows = mask.numel() // max(mask.shape[-1], 1)
        return rows * min(mask.shape[-1], self.response_tokens)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            tensor = args[0]
            return True if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1
        if func is _aten.nonzero.default:
            mask = args[0]
            return torch.zeros(self._selected(mask), mask.dim(), dtype=torch.long, device=mask.device)
        if func is _aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            source, indices = args
            positions: list[torch.Tensor | None] = []
            for index in indices:
                if index is not None and index.dtype == torch.bool:
                    count = self._selected(index)
                    positions.extend(torch.zeros(count, dtype=torch.long, device=index.device) for _ in index.shape)
                else:
                    positions.append(index)
            return func(source, positions)
        return func(*args, **kwargs)


def _gpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the kernel a GPU picks: flash, or memory-efficient with a mask or in fp32.

    On a device it does not know, PyTorch falls back to the math kernel, which holds the
    ``[B, H, L, L]`` attention weights; both GPU kernels keep only the output and one
    log-sum-exp per position. Grouped key/value heads are repeated first, as the kernels'
    inputs must match.
    """
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16):
        return _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    return _aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


@contextlib.contextmanager
def _gpu_attention_kernels() -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` is :func:`_gpu_attention` for the dry run."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _gpu_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _caller() -> str:
    """Where a collective was called from: the innermost frame outside torch, and the innermost of opd's own."""
    torch_root = Path(torch.__file__).resolve().parent
    outside_torch = opd_frame = None
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == Path(__file__).resolve() or path.is_relative_to(torch_root):
            continue
        shown = path.relative_to(_OPD_ROOT.parent) if path.is_relative_to(_OPD_ROOT) else path
        where = f"{shown}:{frame.lineno} in {frame.name}"
        outside_torch = outside_torch or where
        if path.is_relative_to(_OPD_ROOT):
            opd_frame = where
            break
    if outside_torch == opd_frame:
        return outside_torch or "an unknown place"
    return f"{outside_torch} (within {opd_frame})" if opd_frame else str(outside_torch)


class _DeviceAudit(TorchDispatchMode):
    """Fails any collective that is handed a tensor off the compute device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.collectives += 1
            tensors, _ = tree_flatten((args, kwargs))
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor) and tensor.device.type != self.device.type:
                    raise DeviceMismatchError(
                        f"device audit: the collective {func} received a {tensor.dtype} tensor of shape "
                        f"{tuple(tensor.shape)} on '{tensor.device}', but the trainer computes on the accelerator "
                        f"('{self.device}' in this dry run, a GPU on a cluster); an NCCL process group has no CPU "
                        f"backend, so this fails the first step on GPUs. Called from {_caller()}"
                    )
        return func(*args, **kwargs)


def _symmetric_all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """``all_gather_object`` over a fake group: every rank of a dry run holds what this rank holds.

    A fake process group moves no bytes, so pickled objects cannot travel through it.
    """
    object_list[:] = [obj] * len(object_list)


@contextlib.contextmanager
def _tensors_from_data_via_host() -> Iterator[None]:
    """``torch.tensor(data, device=...)`` made on the host, then moved to the device under the fake mode.

    PyTorch builds a tensor from Python data below the dispatcher's modes, with a real
    allocation on the target device, which the stand-in accelerator does not have. Made
    on the host first, the move to the device is an ordinary (fake) operation; the
    tensor's device, dtype and shape are what the code asked for.
    """
    originals = torch.tensor, torch.as_tensor

    def via_host(original: Any) -> Any:
        @functools.wraps(original)
        def make(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
            tensor = original(data, *args, **kwargs)
            return tensor if device is None else tensor.to(device)

        return make

    torch.tensor, torch.as_tensor = via_host(torch.tensor), via_host(torch.as_tensor)
    try:
        yield
    finally:
        torch.tensor, torch.as_tensor = originals


@contextlib.contextmanager
def _sharding_metadata_apart() -> Iterator[None]:
    """DTensor works out an operator's output metadata in a fake mode of its own, as it does on a GPU.

    To find an output's global shape, DTensor runs the operator on fake tensors of the
    global shapes, in the active fake mode when there is one. In the dry run that is the
    tracked mode, which would count a whole, unsharded tensor for every sharded operation
    (the optimizer's, the gradient norm's). On a real device there is no active fake mode
    and those tensors cost nothing; a fresh mode restores that.
    """
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, shard_group_size: int | None = None) -> Iterator[Any]:
    """``torch.distributed``'s fake process group as rank ``rank`` of ``world_size``; yields the trainer's mesh.

    The mesh is the one a real trainer makes (:func:`opd.distributed.fsdp.device_mesh`):
    1-D, or the 2-D HSDP mesh with ``shard_group_size``.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = compute_device()
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process of its own: a process group is already initialised")
    backends = "cpu:fake" if is_cpu(device) else f"cpu:fake,{device.type}:fake"
    dist.init_process_group(backends, store=FakeStore(), rank=rank, world_size=world_size)
    original = dist.all_gather_object
    dist.all_gather_object = _symmetric_all_gather_object
    slicing = DeviceMesh.__getitem__

    def sliced_with_real_tensors(mesh: DeviceMesh, names: Any) -> DeviceMesh:
        # A sub-mesh (HSDP's "shard" dimension) finds this rank's coordinates in the mesh's
        # rank tensor, a data-dependent step that the fake modes would answer with stand-ins.
        with _disable_current_modes():
            return slicing(mesh, names)

    setattr(DeviceMesh, "__getitem__", sliced_with_real_tensors)  # noqa: B010 (a method, assigned for the run)
    try:
        yield device_mesh(device.type, world_size, shard_group_size)
    finally:
        setattr(DeviceMesh, "__getitem__", slicing)  # noqa: B010
        dist.all_gather_object = original
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- the trainer on fake tensors


_LAYER_DEPTHS: dict[str, int] = {}
"""Model paths built with fewer layers than their config has, for a trace to extrapolate (see :func:`_layer_depths`)."""


@contextlib.contextmanager
def _layer_depths(depths: dict[str, int]) -> Iterator[None]:
    """Builds the models at these paths with these many decoder layers (:mod:`opd.plan.layer_extrapolation`)."""
    _LAYER_DEPTHS.update(depths)
    try:
        yield
    finally:
        _LAYER_DEPTHS.clear()


def _skeleton(path: str, dtype: torch.dtype, depth: int | None = None) -> Any:
    """The model at ``path`` built from its config alone, every tensor on the meta device.

    ``depth`` (else the depth a trace asked for, see :func:`_layer_depths`) builds it with
    that many decoder layers, when its layers are all alike.
    """
    config = model_config(path)
    depth = depth or _LAYER_DEPTHS.get(path)
    if depth is not None and uniform_depth(config) is not None:
        config = with_depth(config, depth)
    with unset_fake_temporarily(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@contextlib.contextmanager
def _models_from_their_configs() -> Iterator[None]:
    """The trainer's model loading with the weights left out: each model is built from its config.

    :func:`~opd.distributed.sharded_loading.load_sharded` builds a model on the meta
    device, shards it and gives each rank storage for its shards, then reads its rows from
    the weight files; here the last step is skipped, and the storage is fake. A whole
    model (a teacher with ``cluster.teacher.sharded: false``) gets fake storage whole.
    """
    from opd.distributed import trainer_worker

    def sharded(
        path: str, dtype: torch.dtype, device: torch.device, loading: Any, shard: Any, added: Any = None
    ) -> Any:
        model = shard(_skeleton(path, dtype))
        model.to_empty(device=device)
        if added is not None:  # a LoRA student's adapters
            added(model)
        return model

    def whole(path: str, dtype: torch.dtype, device: torch.device, config: Any, device_map: str | None = None) -> Any:
        model = _skeleton(path, dtype)
        model.to_empty(device=device)
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()  # to_empty gave the tied head a tensor of its own
        return model

    def head(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False) -> OutputLayer:
        # The output layer is the same at any depth: one decoder layer is built, on the meta device.
        layer = output_layer_of(_skeleton(path, dtype, depth=1), path)
        bias = None if layer.bias is None else torch.empty_like(layer.bias, device=device)
        return OutputLayer(
            torch.empty_like(layer.weight, device=device), bias, layer.logit_multiplier, layer.logit_softcap
        )

    wrap_with_lora = trainer_worker.wrap_with_lora

    def lora_on_meta(model: Any, config: Any) -> Any:
        # peft makes a LoRA student's adapters where the context says, then moves them to
        # the base layer's device, which a fake tensor refuses; made on the meta device,
        # like the skeleton they join, they need no move.
        with unset_fake_temporarily(), torch.device("meta"):
            return wrap_with_lora(model, config)

    names = ("load_sharded", "load_causal_lm", "load_output_layer", "wrap_with_lora")
    originals = [getattr(trainer_worker, name) for name in names]
    for name, stand_in in zip(names, (sharded, whole, head, lora_on_meta), strict=True):
        setattr(trainer_worker, name, stand_in)
    try:
        yield
    finally:
        for name, original in zip(names, originals, strict=True):
            setattr(trainer_worker, name, original)


def _hidden_states_as_module_call(model: Any) -> None:
    """Routes ``model.opd_hidden_states`` through ``model.__call__``, where the memory tracker's hooks are.

    :func:`~opd.distributed.fsdp.shard_model` registers the method with FSDP2, which
    calls its pre- and post-forward steps directly; FSDPMemTracker wraps the module hooks
    that run the same steps. Run as the module's forward, the method does the same work
    under the hooks the tracker sees.
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
    """The micro-batches of one dry-run step on one rank.

    Attributes:
        micro_batch_size: rows per micro-batch.
        prompt_tokens: prompt positions of each row.
        response_tokens: response positions of each row (the positions that carry loss).
        micro_batches: micro-batches per step on this rank (gradient accumulation).
    """

    micro_batch_size: int
    prompt_tokens: int
    response_tokens: int
    micro_batches: int = 1

    @property
    def row_tokens(self) -> int:
        """Positions of one row: prompt and response."""
        return self.prompt_tokens + self.response_tokens


@dataclass
class RankMemory:
    """What one rank holds: the tracker's peak and the step's standing memory, in bytes.

    Attributes:
        rank: the rank.
        peak: the tracker's peak over the step on the compute device.
        peak_breakdown: that peak by the tracker's categories (``Sharded Param``,
            ``Activation``, ``All Gather``, ...), non-zero ones only.
        student_parameters: this rank's shard of the student's fp32 master weights.
        student_gradients: this rank's shard of the student's gradients.
        optimizer_state: this rank's Adam moments (and step counters).
        teacher_parameters: this rank's copy of a colocated teacher (a shard, or whole), or
            of the output layer of a teacher apart that answers a full-vocabulary loss.
        collectives: collectives the audit checked.
        host_peak: bytes of tensors the step made on the host (0 when every tensor is on the device).
        extrapolated_layers: the models traced at a few layers and extrapolated, by path, to
            their depth (:mod:`opd.plan.layer_extrapolation`); empty when every layer was traced.
    """

    rank: int
    peak: int
    peak_breakdown: dict[str, int]
    student_parameters: int
    student_gradients: int
    optimizer_state: int
    teacher_parameters: int
    collectives: int
    host_peak: int = 0
    extrapolated_layers: dict[str, int] = field(default_factory=dict)

    @property
    def standing(self) -> int:
        """Memory held between steps: weights, gradients, optimizer state, the teacher."""
        return self.student_parameters + self.student_gradients + self.optimizer_state + self.teacher_parameters

    @property
    def transient(self) -> int:
        """The rest of the peak: activations, gathered layers, collective buffers, the loss's chunks."""
        return max(self.peak - self.standing, 0)


def _local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (a DTensor counts its local shard)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if id(storage) in seen:
            continue
        seen.add(id(storage))
        total += storage.nbytes()
    return total


def _micro_batch(shape: StepShape, vocab_size: int) -> BatchedDataDict:
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


def _teacher_answer(
    request: TeacherRequest, shape: StepShape, vocab_size: int, hidden_size: int | None
) -> TeacherSignal:
    """A teacher's answer to ``request`` for one micro-batch, as it arrives from another process (host tensors)."""
    rows, length = shape.micro_batch_size, shape.row_tokens
    if isinstance(request, FullVocabRequest):
        if hidden_size is None:
            raise ValueError("a full-vocabulary answer from a teacher apart needs the teacher's hidden size")
        return TeacherHiddenStates(torch.zeros(rows, length, hidden_size, dtype=torch.bfloat16))
    if isinstance(request, TopKRequest):
        k = min(request.k, vocab_size)
        return TopKLogprobs(
            torch.zeros(rows, length, k), torch.zeros(rows, length, k, dtype=torch.long), torch.zeros(rows, length)
        )
    if isinstance(request, TokenLogprobsRequest):
        return torch.zeros(rows, length)
    raise ValueError(f"the dry run does not plan a teacher apart answering {type(request).__name__}")


def _adam_state_in_place(trainer: TrainerWorker) -> None:
    """Gives every parameter Adam's moments, as any step after the first finds them.

    One optimizer step over zero gradients (no model step): the tracked step then holds
    the optimizer state throughout, as every step of a run but the first does. The
    learning-rate schedule is not stepped.
    """
    for parameter in trainer.model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _fake_step(
    rank: int, world_size: int, shard_group_size: int | None, shape: StepShape, audit: _DeviceAudit
) -> Iterator[Any]:
    """Everything a dry-run step runs under (see the module docstring); yields the process group's mesh."""
    with (
        fake_process_group(rank, world_size, shard_group_size) as mesh,
        FakeTensorMode(allow_non_fake_inputs=True),
        _tensors_from_data_via_host(),
        _gpu_attention_kernels(),
        _sharding_metadata_apart(),
        _models_from_their_configs(),
        _DataDependentStandIns(shape.response_tokens),
        audit,
    ):
        yield mesh


@dataclass
class ReplicaMemory:
    """What one device of a teacher-pool replica holds while it scores a micro-batch, in bytes.

    Attributes:
        peak: the tracker's peak over the forward on the compute device.
        weights: this device's share of the teacher (its FSDP2 shard, or the whole model).
        answer: the answer it sends (hidden states, top-k or token log-probs), on the device before it is sent.
        extrapolated_layers: as :attr:`RankMemory.extrapolated_layers`.
    """

    peak: int
    weights: int
    answer: int
    extrapolated_layers: dict[str, int] = field(default_factory=dict)


def _traced_or_extrapolated(
    trace_at: Callable[[dict[str, int]], Trace], paths: Sequence[str], every_layer: bool
) -> Trace:
    """The step's figures at the models' real depths: traced whole, or from two shallow traces.

    ``trace_at(depths)`` runs the dry run with the models at ``depths``'s paths cut to that
    many layers. Models whose layers are all alike and that are deeper than
    ``BASE_DEPTH + 1`` are traced at ``BASE_DEPTH`` layers and at one more, one model at a
    time, and extrapolated (:mod:`opd.plan.layer_extrapolation`); with
    ``every_layer``, or when no model qualifies, the step is traced at full depth.
    """
    full_depths: dict[str, int] = {}
    for path in dict.fromkeys(paths):
        depth = uniform_depth(model_config(path))
        if depth is not None:
            full_depths[path] = depth
    varied = {} if every_layer else extrapolated_depths(full_depths)
    if varied:
        base_depths = dict.fromkeys(varied, BASE_DEPTH)
        base = trace_at(base_depths)
        deeper = {path: trace_at({**base_depths, path: BASE_DEPTH + 1}) for path in varied}
        extrapolated = extrapolate(base, deeper, {path: depth - BASE_DEPTH for path, depth in varied.items()})
        if extrapolated is not None:
            return extrapolated
    return trace_at({})


def _phase_peaks(tracker: Any, models: dict[str, Any], micro_batch_root: Any) -> PhasePeaks:
    """A :class:`PhasePeaks` over these models' decoder layers; a model cut to fewer layers must have them."""
    layers = {}
    for name, (path, model) in models.items():
        found = decoder_layers(model, model.config.num_hidden_layers)
        if not found and path in _LAYER_DEPTHS:
            raise ValueError(f"the dry run cut {path} to {_LAYER_DEPTHS[path]} layers but finds no list of them")
        layers[name] = (model, found)
    return PhasePeaks(tracker, layers, micro_batch_root)


def _check_phase_peaks(phases: PhasePeaks, tracker: Any, device: torch.device) -> None:
    """The largest phase peak is the tracker's own peak on every device: no op went unrecorded."""
    own = {dev.type: int(values.get("Total", 0)) for dev, values in tracker.get_tracker_snapshot("peak").items()}
    kept = {kind: snapshot["Total"] for kind, snapshot in phases.peak().items()}
    if own != kept:
        raise RuntimeError(f"the dry run's phase peaks {kept} are not the memory tracker's peaks {own}")


def _peak_on(peak: dict[str, Snapshot], device: torch.device) -> tuple[int, Snapshot]:
    """The compute device's peak snapshot, and the host's peak bytes (the other devices' peaks, summed)."""
    host = sum(snapshot.get("Total", 0) for kind, snapshot in peak.items() if kind != device.type)
    return host, peak.get(device.type, {})


def dry_run_teacher_replica(
    path: str,
    dtype: torch.dtype,
    shards_per_replica: int,
    shape: StepShape,
    request: TeacherRequest,
    *,
    every_layer: bool = False,
) -> ReplicaMemory:
    """Scores one micro-batch on the first device of a teacher-pool replica, on fake tensors; returns its memory.

    The replica is built as a pool worker builds it (:class:`opd.distributed.teacher_pool.TeacherWorker`):
    the whole teacher on one device, or with ``shards_per_replica`` > 1 sharded with FSDP2
    over the replica's devices, forward only. A full-vocabulary request is answered with
    the final hidden states (the trainer binds them to its copy of the head); the others
    with the answer itself. A deep teacher with alike layers is traced at a few layers and
    extrapolated, unless ``every_layer`` (:func:`_traced_or_extrapolated`).
    """
    device = compute_device()

    def trace_at(depths: dict[str, int]) -> Trace:
        with _layer_depths(depths):
            return _trace_teacher_replica(path, dtype, shards_per_replica, shape, request, device)

    trace = _traced_or_extrapolated(trace_at, [path], every_layer)
    _, snapshot = _peak_on(largest_phase_peak(trace.peaks), device)
    return ReplicaMemory(
        peak=snapshot.get("Total", 0),
        weights=trace.scalars["weights"],
        answer=trace.scalars["answer"],
        extrapolated_layers=trace.extrapolated,
    )


def _trace_teacher_replica(
    path: str,
    dtype: torch.dtype,
    shards_per_replica: int,
    shape: StepShape,
    request: TeacherRequest,
    device: torch.device,
) -> Trace:
    """One dry run of :func:`dry_run_teacher_replica`, at the depths the context sets."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with _fake_step(0, shards_per_replica, None, shape, _DeviceAudit(device)) as mesh:
        model = _skeleton(path, dtype)
        if shards_per_replica > 1:
            model = shard_model(model, mesh)
        model.to_empty(device=device)
        if shards_per_replica == 1 and getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()  # to_empty gave the tied head a tensor of its own
        # One pass over each row: the shared-prompt forward groups rows by their token values,
        # which fake tensors do not hold (its prompt cache, the prompts' keys and values, is not counted).
        teacher = ShardedTeacher(model) if shards_per_replica > 1 else LocalTeacher(model, share_prompt_forward=False)
        # The tracker hooks every parameter's gradient, which a frozen weight refuses; the
        # teacher still scores without gradients (its own no-grad mode), so nothing changes.
        model.requires_grad_(True)
        weights = _local_bytes(model.parameters())
        batch = _micro_batch(shape, model.config.vocab_size)
        tracker = MemTracker()
        tracker.track_external(model)
        phases = _phase_peaks(tracker, {"teacher": (path, model)}, None)
        with tracker, torch.no_grad():
            phases.record()
            if isinstance(request, FullVocabRequest):
                answer: Any = teacher.get_hidden_states(batch).hidden_states
            else:
                answer = teacher.score(batch, request)
        # Top-k: the pair of tensors and the rest mass; the other answers are one tensor.
        answer_bytes = _local_bytes([answer] if torch.is_tensor(answer) else [*answer, answer.rest_logprobs])
    _check_phase_peaks(phases, tracker, device)
    return Trace({"weights": weights, "answer": answer_bytes}, phases.peaks)


def dry_run_rank(
    spec: TrainerSpec,
    world_size: int,
    rank: int,
    shape: StepShape,
    loss_fn: LossFunction,
    vocab_size: int,
    teacher_hidden_size: int | None = None,
    *,
    every_layer: bool = False,
) -> RankMemory:
    """Builds and trains rank ``rank`` of ``world_size`` on fake tensors; returns its memory.

    The tracked step is a steady-state one: Adam's moments exist before it starts
    (:func:`_adam_state_in_place`), as they do from a run's second step on. A teacher
    that runs apart (``spec.teacher_path`` None: a pool, a served teacher) sends its
    answer to every micro-batch as it would arrive from another process, on the host:
    the final hidden states for a full-vocabulary loss (bound to the output layer the
    rank loads, ``spec.teacher_head_path``), else the top-k or token log-probs.

    A deep student or colocated teacher with alike layers is traced at a few layers and
    extrapolated to its depth, unless ``every_layer`` (:func:`_traced_or_extrapolated`);
    the device audit sees every kind of collective either way.

    Args:
        spec: the trainer as the run configures it (``backend`` is ignored: the group is fake).
        world_size: trainer ranks.
        rank: the rank to run.
        shape: its micro-batches.
        loss_fn: the run's loss.
        vocab_size: token ids are drawn below this.
        teacher_hidden_size: the width of a teacher's hidden states that runs apart and
            answers a full-vocabulary loss; unused otherwise.
        every_layer: trace every layer of every model, extrapolating nothing.

    Raises:
        DeviceMismatchError: a collective got a tensor off the compute device.
    """
    device = compute_device()

    def trace_at(depths: dict[str, int]) -> Trace:
        with _layer_depths(depths):
            return _trace_rank(spec, world_size, rank, shape, loss_fn, vocab_size, teacher_hidden_size, device)

    trace = _traced_or_extrapolated(trace_at, [spec.student_path, *spec.colocated_teachers()], every_layer)
    host_peak, snapshot = _peak_on(largest_phase_peak(trace.peaks), device)
    return RankMemory(
        rank=rank,
        peak=snapshot.get("Total", 0),
        peak_breakdown={kind: value for kind, value in snapshot.items() if value and kind != "Total"},
        student_parameters=trace.scalars["student_parameters"],
        student_gradients=trace.scalars["student_gradients"],
        optimizer_state=trace.scalars["optimizer_state"],
        teacher_parameters=trace.scalars["teacher_parameters"],
        collectives=trace.scalars["collectives"],
        host_peak=host_peak,
        extrapolated_layers=trace.extrapolated,
    )


def _trace_rank(
    spec: TrainerSpec,
    world_size: int,
    rank: int,
    shape: StepShape,
    loss_fn: LossFunction,
    vocab_size: int,
    teacher_hidden_size: int | None,
    device: torch.device,
) -> Trace:
    """One dry run of :func:`dry_run_rank`, at the depths the context sets."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    # A whole colocated teacher runs one pass over each row, as a pool replica's dry run
    # does: the shared-prompt forward groups rows by their token values, which fake tensors
    # do not hold (its prompt cache, the prompts' keys and values, is not counted).
    spec = replace(spec, teacher_share_prompt_forward=(False,) * len(spec.colocated_teachers()))
    global_tokens = shape.micro_batch_size * shape.response_tokens * shape.micro_batches * world_size
    global_rows = shape.micro_batch_size * shape.micro_batches * world_size
    audit = _DeviceAudit(device)
    with _fake_step(rank, world_size, spec.shard_group_size, shape, audit) as mesh:
        micro_batch = _micro_batch(shape, vocab_size)  # fake host tensors, as the controller sends them
        request = loss_fn.teacher_request
        # A teacher apart sends its answer; a colocated one answers in the worker (as the driver's facade says).
        signals: list[TeacherSignal] | None = (
            None
            if request is None
            else [_teacher_answer(request, shape, vocab_size, teacher_hidden_size)] * shape.micro_batches
            if spec.teacher_path is None
            else [AnsweredWhereTrained(request)] * shape.micro_batches
        )
        trainer = TrainerWorker(rank, world_size, spec)
        trainer.build(mesh, device)
        _adam_state_in_place(trainer)
        # The teacher's weights on this rank: a colocated copy, or the output layer that binds
        # the hidden states of a teacher apart.
        teacher_tensors: list[torch.Tensor] = []
        if trainer.teacher_members:
            teacher_tensors = list(trainer.teacher_members[0].model.parameters())
        elif trainer.teacher_heads and trainer.teacher_heads[0] is not None:
            head = trainer.teacher_heads[0]
            teacher_tensors = [head.weight] + ([head.bias] if head.bias is not None else [])
        teacher_bytes = _local_bytes(teacher_tensors)
        tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
        kinds = _tracked_kinds()
        tracker._ref_class = kinds
        for tensor in teacher_tensors:  # the tracker counts only the student's own weights unless told
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            tracker._update_and_maybe_create_winfos(local, kinds.TEACHER)
        _hidden_states_as_module_call(trainer.model)
        models = {"student": (spec.student_path, trainer.model)}
        for index, (path, member) in enumerate(zip(spec.colocated_teachers(), trainer.teacher_members, strict=True)):
            models[f"teacher{index}"] = (path, member.model)
        phases = _phase_peaks(tracker, models, trainer.model)
        with tracker:
            phases.record()
            # The tracker refuses a second forward of the root (a next micro-batch) unless
            # its per-module statistics are cleared; the peak it keeps is unaffected.
            trainer.model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
            trainer.train(loss_fn, global_tokens, global_rows, [micro_batch] * shape.micro_batches, signals)
        parameters = list(trainer.model.parameters())
        optimizer_state = _local_bytes(
            value for state in trainer.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        )
    figures = {
        "student_parameters": _local_bytes(parameters),
        # Gradients live from the backward to the optimizer step (zero_grad sets them to
        # None): one sharded copy of the trained weights (a LoRA student's adapters alone)
        # in the master weights' dtype.
        "student_gradients": _local_bytes(parameter for parameter in parameters if parameter.requires_grad),
        "optimizer_state": optimizer_state,
        "teacher_parameters": teacher_bytes,
        "collectives": audit.collectives,
    }
    _check_phase_peaks(phases, tracker, device)
    return Trace(figures, phases.peaks)
