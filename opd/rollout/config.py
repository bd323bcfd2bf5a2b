"""The engines' settings: the colocated vLLM engine and the generation section (``generation``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from opd.utils.config import StrictConfig


class VllmGenerationConfig(StrictConfig):
    """The colocated vLLM engine (``generation.vllm``, used when ``generation.backend = vllm``).

    The engine runs in the trainer's process (or a rollout worker's) and starts from the
    student's weights in memory; with ``tensor_parallel_size > 1`` its model runs in one
    process per device, spawned by vLLM, which the engine in this process drives. After
    every optimizer step the driver refits it (copies the new weights in).
    On a GPU it shares the device with training: ``gpu_memory_utilization`` bounds its
    share, and with sleep mode it frees its weights and KV cache while the student trains.
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="engine dtype; auto = the student's dtype (greedy rollouts then match HF's)"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="longest prompt + response the engine accepts; null = the model's maximum"
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="GPU only: share of the device the engine may take (weights + KV cache)"
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size in bytes; null = 256 MiB on CPU, gpu_memory_utilization on GPU"
    )
    enforce_eager: Literal["auto"] | bool = Field(
        "auto", description="no CUDA graphs; auto = eager on CPU (where graphs do not exist), graphs on GPU"
    )
    enable_sleep_mode: Literal["auto"] | bool = Field(
        "auto", description="GPU only: offload the engine while the student trains; auto = on where CUDA is"
    )
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="devices one engine spans (vLLM tensor parallel, one process per device); on a cluster each "
        "rollout worker then holds that many GPUs",
    )
