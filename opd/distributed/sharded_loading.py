"""Loading a model straight into its FSDP2 shards: no rank ever holds the whole model.

Loading whole then sharding costs a full copy per rank. Instead the model is built with **parameters on the meta
device** (buffers real: rotary frequencies are in no weight file), sharded, each rank allocates only its shards
(``to_empty``) and reads **its own rows** of every tensor from the safetensors files. Summed over ranks that is
one copy of the model. Every rank needs the model directory. A model without safetensors files (``tiny:``,
``.bin``) is loaded whole on each rank and then sharded, with a log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM

from opd.models.config import ModelLoadingConfig
from opd.models.loading import attention_implementation_for, load_causal_lm
from opd.models.tiny import is_tiny_path
from opd.utils.devices import use_tf32_matmuls
from opd.utils.errors import ConfigError

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

log = logging.getLogger("opd")

ShardFn = Callable[["PreTrainedModel"], "PreTrainedModel"]
"""Shards a model in place (``fully_shard`` over the trainer's mesh) and returns it."""
AddedFn = Callable[["PreTrainedModel"], set[str]]
"""Fills the parameters a sharding function added (LoRA adapters, in no weight file) and returns their names."""

# Wrappers that insert a path segment into parameter names but not into weight files.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_PEFT_BASE_LAYER = ".base_layer."


def load_sharded(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    loading: ModelLoadingConfig,
    shard: ShardFn,
    added: AddedFn | None = None,
) -> PreTrainedModel:
    """The causal LM at ``path``, sharded by ``shard``, each rank holding only its shards (module docstring).

    Args:
        path: a model directory, a hub name already in the local cache, or ``tiny:`` / ``.bin`` (loaded whole).
        dtype: what the shards keep (fp32 masters for a student, compute dtype for a teacher).
        added: when ``shard`` adds modules (LoRA), fills their parameters after sharding; the rest are read
            under their names without peft's ``base_layer.`` segment.

    Raises:
        ConfigError: the directory cannot be read, or its files lack a parameter.
    """
    use_tf32_matmuls(loading.tf32, device)
    files = _safetensors_files(path)
    if not files:
        log.info("loading %s whole on each rank, then sharding (no safetensors files to read slices of)", path)
        model = shard(load_causal_lm(path, dtype, device, loading))
        if added is not None:  # the wrapper's own start is replaced by the caller's
            added(model)
        return model
    model = _build_on_meta(path, dtype, device, loading)
    model = shard(model)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    own = added(model) if added is not None else set()
    _read_local_slices(model, files, path, own, strip_base_layer=added is not None)
    return model


def _safetensors_files(path: str) -> list[Path]:
    """The model's safetensors files: in ``path`` itself, or in this node's hub cache's snapshot of it.

    Raises:
        ConfigError: ``path`` names a hub model this node's cache lacks (naming the node). Loading it whole on
            every rank instead would put the whole model on every device, and download it once per rank.
    """
    if is_tiny_path(path):
        return []
    directory = Path(path).expanduser()
    if not directory.is_dir():
        if directory.exists() or not _is_hub_name(path):  # one file (GGUF), or no model: the whole-model loader
            return []
        from huggingface_hub import constants, snapshot_download

        try:  # its files are where transformers cached them (nothing is downloaded here)
            directory = Path(snapshot_download(path, local_files_only=True))
        except Exception as error:
            raise ConfigError(
                f"the model {path!r} is not in the Hugging Face cache of node {_node_name()} "
                f"({constants.HF_HUB_CACHE}; {type(error).__name__}): every rank reads its own slices of the "
                f"weights from local files, so download it on every node first (`hf download {path}`), or give "
                "a directory every node reads"
            ) from None
    return sorted(directory.glob("*.safetensors"))


def _is_hub_name(path: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _node_name() -> str:
    """This machine's host name, and its Ray node address inside a Ray worker."""
    import socket

    name = socket.gethostname()
    with contextlib.suppress(Exception):  # outside Ray, or Ray without a node address
        import ray

        if ray.is_initialized():
            name = f"{name} ({ray.util.get_node_ip_address()})"
    return name


def _build_on_meta(path: str, dtype: torch.dtype, device: torch.device, loading: ModelLoadingConfig) -> PreTrainedModel:
    """The architecture of ``path`` with its parameters on the meta device and its buffers computed."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=loading.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the model config of '{path}': {str(error).splitlines()[0]}") from None
    kwargs: dict[str, Any] = {"trust_remote_code": loading.trust_remote_code, "dtype": dtype}
    if attention := attention_implementation_for(loading, device, dtype):
        kwargs["attn_implementation"] = attention
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.tie_weights()
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers (not in weight files) stay real."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _file_name(parameter_name: str, strip_base_layer: bool = False) -> str:
    for segment in _WRAPPER_SEGMENTS:
        parameter_name = parameter_name.replace(segment, "")
    if strip_base_layer:  # peft's LoRA layer holds the original one as its base_layer
        parameter_name = parameter_name.replace(_PEFT_BASE_LAYER, ".")
    return parameter_name


def _read_local_slices(
    model: PreTrainedModel, files: list[Path], path: str, skip: Container[str] = (), strip_base_layer: bool = False
) -> None:
    """Copies this rank's slice of every parameter but ``skip`` from the files (tied parameters once)."""
    wanted = {  # named_parameters yields a tied parameter once, under its first name
        _file_name(name, strip_base_layer): parameter
        for name, parameter in model.named_parameters()
        if name not in skip
    }
    missing = set(wanted)
    staging = _Staging()
    for file in files:
        entries, data_start = _safetensors_header(file, path)
        with open(file, "rb", buffering=0) as handle:
            for key, entry in entries.items():
                if key not in wanted:
                    continue
                if list(entry["shape"]) != list(wanted[key].shape):
                    raise ConfigError(
                        f"'{path}': {key} has shape {entry['shape']} in {file.name} but {list(wanted[key].shape)} "
                        "in the model's config.json"
                    )
                _copy_local_rows(wanted[key], handle, entry, data_start, staging)
                missing.discard(key)
    if missing:
        raise ConfigError(
            f"the safetensors files of '{path}' lack {len(missing)} of the model's parameters "
            f"(first: {sorted(missing)[0]}); the files do not match the model's config.json"
        )


# safetensors: 8-byte little-endian header length, JSON header (dtype, shape, byte range), row-major bytes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safetensors_header(file: Path, path: str) -> tuple[dict[str, Any], int]:
    """The tensors' entries of a safetensors file, and where its data starts."""
    try:
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {file} of '{path}': {error}; the file is damaged or not safetensors") from None
    header.pop("__metadata__", None)
    unknown = {entry["dtype"] for entry in header.values()} - set(_SAFETENSORS_DTYPES)
    if unknown:
        raise ConfigError(f"{file} of '{path}' holds tensors of dtype {sorted(unknown)}, which opd cannot load")
    return header, 8 + length


class _Staging:
    """One reusable host buffer that rows pass through when they change dtype or device.

    Fresh temporaries go back to the allocator, not the system, so resident memory would grow by every slice read.
    """

    BYTES = 64 * 2**20

    def __init__(self) -> None:
        self.buffer = torch.empty(self.BYTES, dtype=torch.uint8)

    def rows(self, row_bytes: int) -> int:
        return max(1, self.BYTES // max(row_bytes, 1))

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.buffer.numel():  # one row larger than the buffer: grow it once
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes]


def _read_exactly(handle: Any, offset: int, target: torch.Tensor) -> None:
    """Fills the contiguous uint8 CPU tensor ``target`` with the file's bytes from ``offset``."""
    view = memoryview(target.numpy()).cast("B")  # type: ignore[arg-type]
    handle.seek(offset)
    done = 0
    while done < len(view):
        count = handle.readinto(view[done:])
        if not count:
            raise ConfigError(f"{handle.name} ends early: the safetensors file is truncated")
        done += count


def _copy_local_rows(
    parameter: torch.Tensor, handle: Any, entry: dict[str, Any], data_start: int, staging: _Staging
) -> None:
    """Reads the part of ``entry`` that this rank's shard of ``parameter`` holds, straight into it.

    A row shard is one contiguous byte range; a shard also split on another dimension reads whole rows through
    the staging buffer and keeps its part.
    """
    if isinstance(parameter, DTensor):
        local = parameter.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            parameter.shape, parameter.device_mesh, parameter.placements
        )
    else:
        local, shape, offset = parameter, tuple(parameter.shape), (0,) * parameter.dim()
    if local.numel() == 0:
        return
    full = tuple(parameter.shape)
    whole_rows = tuple(shape[1:]) == full[1:]
    file_dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    row_elements = math.prod(full[1:])
    row_bytes = row_elements * file_dtype.itemsize
    first_row = offset[0] if offset else 0
    begin = data_start + entry["data_offsets"][0] + first_row * row_bytes
    rows = shape[0] if shape else 1
    # The part of a whole row this shard keeps (all of it for fully_shard's row shards).
    within = (slice(None), *(slice(start, start + size) for start, size in zip(offset[1:], shape[1:], strict=True)))
    with torch.no_grad():
        if whole_rows and local.is_cpu and local.dtype == file_dtype and local.is_contiguous():
            _read_exactly(handle, begin, local.view(torch.uint8).view(-1))
            return
        target = local.view(rows, *shape[1:])
        step = staging.rows(row_bytes)
        for row in range(0, rows, step):
            count = min(step, rows - row)
            raw = staging.take(count * row_bytes)
            _read_exactly(handle, begin + row * row_bytes, raw)
            block = raw.view(file_dtype).view(count, *full[1:])
            target[row : row + count].copy_(block[within])
