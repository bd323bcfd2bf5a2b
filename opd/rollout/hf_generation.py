"""Student generation with the in-process Hugging Face model (the default backend) and its kind, :class:`HFEngine`.

It samples with the model being trained, so no refit is needed. The decode loop is opd's
(:mod:`opd.rollout.decode_loop`, default) or transformers' ``generate``; prompts are left-padded for decoding and
the output is laid out right-padded (``[prompt | response | pad]``). Log-probs are those of the distribution the
token was drawn from (after temperature / top-k / top-p).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import InProcessGenerationInterface, PolicyInterface
from opd.models.lm_head import token_log_probs
from opd.rollout.decode_loop import compile_decode_step, decode
from opd.rollout.engine_kind import RUNTIME_RESERVE, EngineKind, HeldMemory, PlannedRollout, RolloutWorkerMemory, gib
from opd.rollout.rollout_batch import build_rollout_batch
from opd.rollout.stop_tokens import is_stop, stop_token_ids
from opd.utils.compile_cache import resolve_compile_kernels

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

_Sampler = Callable[
    [torch.Tensor, torch.Tensor, GenerateStrategyConfig, bool], tuple[torch.Tensor, torch.Tensor | None]
]
"""One decode loop: left-padded prompts, their mask, the strategy, whether to return log-probs."""

LOGITS_COPIES = 3
"""fp32 ``[rows, V]`` tensors a decode step holds at once: the logits, the warped logits, their softmax."""
_ROWS_REMEDY = "sample fewer rows per engine (training.batch_size, distillation.num_samples_per_prompt)"


def sampling_kwargs(strategy: GenerateStrategyConfig) -> dict[str, Any]:
    """Maps ``generate_strategy`` onto ``generate`` keyword arguments.

    Every knob is explicit, so the model's own ``generation_config`` (Qwen's sets top_k, top_p and a repetition
    penalty) cannot change the sampling; ``top_k = 0`` and ``top_p = 1`` are ``generate``'s "no cut".
    """
    fixed = {"repetition_penalty": 1.0, "num_beams": 1}
    if strategy.is_greedy:
        return {**fixed, "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    kept = strategy.sampling_filter
    top_k = kept.top_k if kept.top_k is not None else 0
    return {**fixed, "do_sample": True, "temperature": strategy.temperature, "top_k": top_k, "top_p": kept.top_p}


class HFGeneration(InProcessGenerationInterface):
    """``GenerationInterface`` over an in-process ``PreTrainedModel`` (the student itself).

    Args:
        decode_loop: ``opd`` (opd's KV-cache loop) or ``generate`` (``model.generate``).
        compile_decode: compile the opd loop's one-token step (ignored by ``generate``).
        stop_ids: the tokens that end a response; None = :func:`~opd.rollout.stop_tokens.stop_token_ids`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        decode_loop: str = "opd",
        compile_decode: bool = False,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        # Each loop, and whether it takes a compiled one-token step (generate runs its own steps).
        loops: dict[str, tuple[_Sampler, bool]] = {
            "opd": (self._sample_with_opd_loop, True),
            "generate": (self._sample_with_generate, False),
        }
        if decode_loop not in loops:
            raise ValueError(f"decode_loop must be one of {sorted(loops)}, got {decode_loop!r}")
        self.model = model
        self.decode_loop = decode_loop
        """``opd`` or ``generate``: which loop samples (``generation.decode_loop``)."""
        self._sample, takes_compiled_step = loops[decode_loop]
        self.step_forward = compile_decode_step(model) if compile_decode and takes_compiled_step else None
        self.pad_token_id = tokenizer.pad_token_id
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, model)
        self._was_training = False

    def prepare_for_generation(self) -> None:
        """Puts the model in eval mode (no dropout while sampling)."""
        self._was_training = self.model.training
        self.model.eval()

    def finish_generation(self) -> None:
        """Restores the model's train/eval mode."""
        self.model.train(self._was_training)

    @property
    def weights_dtype(self) -> torch.dtype:
        """The model's dtype."""
        return self.model.dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies the pairs into the model in place, by state-dict name (a rollout worker's refit)."""
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                own[name].copy_(tensor)

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """Samples ``num_samples`` responses per prompt (see ``GenerationInterface``).

        ``return_logprobs=False`` skips the per-step log-softmax; the batch then has no ``generation_logprobs``.
        """
        expanded = [prompt for prompt in prompts for _ in range(num_samples)]
        prompt_width = max(len(prompt) for prompt in expanded)
        left_padded = torch.full((len(expanded), prompt_width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(left_padded)
        for row, prompt in enumerate(expanded):
            left_padded[row, prompt_width - len(prompt) :] = torch.tensor(prompt)
            attention[row, prompt_width - len(prompt) :] = 1
        with torch.inference_mode():
            new_tokens, new_token_logprobs = self._sample(left_padded, attention, strategy, return_logprobs)
        # Tensors born in inference mode cannot enter the student's autograd graph later;
        # clones made outside it are ordinary tensors.
        return self._right_pad(
            expanded, new_tokens.clone(), new_token_logprobs.clone() if new_token_logprobs is not None else None
        )

    def _sample_with_opd_loop(
        self,
        left_padded: torch.Tensor,
        attention: torch.Tensor,
        strategy: GenerateStrategyConfig,
        return_logprobs: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """opd's decode loop; returns the new tokens and (if asked) their sampling log-probs (on CPU)."""
        device = next(self.model.parameters()).device
        new_tokens, token_logprobs = decode(
            self.model,
            left_padded.to(device),
            attention.to(device),
            strategy,
            self.stop_ids,
            self.pad_token_id,
            return_logprobs,
            self.step_forward,
        )
        return new_tokens.cpu(), token_logprobs.cpu() if token_logprobs is not None else None

    def _sample_with_generate(
        self,
        left_padded: torch.Tensor,
        attention: torch.Tensor,
        strategy: GenerateStrategyConfig,
        return_logprobs: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """transformers' ``model.generate``; returns the new tokens and (if asked) their sampling log-probs (on CPU)."""
        device = next(self.model.parameters()).device
        prompt_width = left_padded.shape[1]
        # transformers types generate()'s output as a union this call never returns.
        output: Any = cast(Any, self.model).generate(
            input_ids=left_padded.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=strategy.max_length,
            eos_token_id=list(self.stop_ids),
            pad_token_id=self.pad_token_id,
            use_cache=True,
            output_scores=return_logprobs,
            return_dict_in_generate=True,
            **sampling_kwargs(strategy),
        )
        new_tokens = output.sequences[:, prompt_width:].cpu()
        if not return_logprobs:
            return new_tokens, None
        # log_softmax of the processed scores = log-prob under the sampling distribution.
        # Gathered step by step: stacking [B, T, V] scores would not fit for a 150k vocab.
        token_logprobs = torch.stack(
            [
                token_log_probs(torch.log_softmax(step_scores.float(), dim=-1), output.sequences[:, prompt_width + t])
                for t, step_scores in enumerate(output.scores)
            ],
            dim=1,
        ).cpu()
        return new_tokens, token_logprobs

    def _right_pad(
        self, prompts: list[list[int]], new_tokens: torch.Tensor, new_token_logprobs: torch.Tensor | None
    ) -> BatchedDataDict:
        """Cuts each row after its first stop token and lays the rows out as ``[prompt | response | pad]``."""
        stops = is_stop(new_tokens, torch.tensor(self.stop_ids, dtype=torch.long))
        has_stop = stops.any(dim=1)
        # Response = tokens up to and including the first stop token (all of them if none).
        first_stop = torch.where(has_stop, stops.int().argmax(dim=1), new_tokens.shape[1] - 1)
        response_lengths = (first_stop + 1).tolist()
        return build_rollout_batch(
            prompts,
            [new_tokens[row, :length] for row, length in enumerate(response_lengths)],
            None
            if new_token_logprobs is None
            else [new_token_logprobs[row, :length] for row, length in enumerate(response_lengths)],
            ~has_stop,
            self.pad_token_id,
        )


class SnapshotHFGeneration(HFGeneration):
    """An in-process HF engine on a deep copy of the student, refreshed only by :meth:`refit`.

    Sampling with the last refit's weights, as a rollout worker does, lets an asynchronous schedule
    (:mod:`opd.distillation.step`) draw in one process exactly the samples it would on a cluster. Nothing
    overlaps, so it reproduces and debugs an asynchronous run; it does not speed one up.
    """

    needs_refit = True

    def __init__(self, model: PreTrainedModel, tokenizer: Any, **options: Any) -> None:
        snapshot = copy.deepcopy(model)
        snapshot.requires_grad_(False)
        super().__init__(snapshot, tokenizer, **options)

    def refit(self, policy: PolicyInterface) -> dict[str, float]:
        """Copies the policy's current weights into the engine's copy (within this process: nothing to log)."""
        self.load_weights(policy.weights_for_refit())
        return {}


class HFSettings(Protocol):
    """What the HF engine reads of the ``generation`` section."""

    @property
    def decode_loop(self) -> str: ...

    @property
    def compile_decode(self) -> Literal["auto"] | bool: ...

    @property
    def stop_token_ids(self) -> list[int] | None: ...


@dataclass
class HFEngineMemory:
    """A rollout worker's HF engine on one device, in bytes: its copy of the student and what its rollout needs.

    It reserves nothing up front; the KV cache grows up to every row at full length (``rows`` × ``row_tokens``).
    ``activations`` estimates the larger of the prefill's one layer over every prompt and a step's fp32 logits.
    ``weights`` is the worker's copy of the student (:meth:`HFEngine.worker_memory` counts it as the worker's).
    """

    device_bytes: int
    trainer_resident: int
    weights: int
    kv_cache: int
    activations: int
    rows: int
    row_tokens: int

    @property
    def total(self) -> int:
        """The trainer's resident state plus everything the engine holds."""
        return self.trainer_resident + self.weights + self.kv_cache + self.activations

    @property
    def while_sampling(self) -> HeldMemory:
        """The rows' KV cache and activations (its weights are the worker's copy, counted with the worker)."""
        return HeldMemory(self.kv_cache + self.activations, "HF KV cache and activations", _ROWS_REMEDY)

    @property
    def at_refit(self) -> HeldMemory:
        """The same: the worker's caching allocator keeps the last rollout's blocks (nothing empties it)."""
        return HeldMemory(self.kv_cache + self.activations, "HF KV cache and activations (cached)", _ROWS_REMEDY)

    def describe(self) -> str:
        """The sum, against the device."""
        return (
            f"trainer {gib(self.trainer_resident)} + weights {gib(self.weights)} + KV {gib(self.kv_cache)} "
            f"({self.rows:,} sequences of {self.row_tokens}) + activations {gib(self.activations)} "
            f"= {gib(self.total)} of {gib(self.device_bytes)} GiB"
        )


def _student_copy_bytes(rollout: PlannedRollout) -> int:
    """The student's weights as a rollout worker loads them (``model.dtype``)."""
    return rollout.student_element_bytes * rollout.student_parameters


class HFEngine(EngineKind[HFSettings]):
    """``hf``: the student's own Hugging Face model (:class:`HFGeneration`)."""

    name = "hf"
    memory_arithmetic = "HF's decode loop: a copy of the student and its rows' KV cache"

    def planned_memory(self, settings: HFSettings, rollout: PlannedRollout) -> HFEngineMemory:
        """A rollout worker's copy of the student, the KV cache of its rows at full length, the prefill and logits."""
        prefill = rollout.rows * rollout.prompt_tokens * rollout.layer_activation_bytes_per_token
        logits = LOGITS_COPIES * rollout.rows * rollout.vocab_size * 4
        return HFEngineMemory(
            device_bytes=rollout.device_bytes,
            trainer_resident=rollout.trainer_resident,
            weights=_student_copy_bytes(rollout),
            kv_cache=rollout.rows * rollout.row_tokens * rollout.kv_bytes_per_token,
            activations=max(prefill, logits),
            rows=rollout.rows,
            row_tokens=rollout.row_tokens,
        )

    def worker_memory(self, settings: HFSettings, rollout: PlannedRollout) -> RolloutWorkerMemory:
        """The worker's CUDA context and the student it loaded, which the engine samples in place (one copy: the worker
        builds the engine with ``own_copy=False``, so no snapshot of it is made)."""
        copy_bytes = _student_copy_bytes(rollout)
        element = f"{rollout.student_element_bytes * 8}-bit"
        return RolloutWorkerMemory(RUNTIME_RESERVE, copy_bytes, f"{element}, the HF engine's weights above")

    def build(
        self, settings: HFSettings, model: PreTrainedModel, tokenizer: Any, seed: int, own_copy: bool
    ) -> InProcessGenerationInterface:
        """An HF engine over ``model`` (or over a snapshot of it: an asynchronous schedule samples stale weights)."""
        device_type = next(model.parameters()).device.type
        engine = SnapshotHFGeneration if own_copy else HFGeneration
        return engine(
            model,
            tokenizer,
            decode_loop=settings.decode_loop,
            compile_decode=resolve_compile_kernels(settings.compile_decode, device_type, "generation.compile_decode"),
            stop_ids=settings.stop_token_ids,
        )
