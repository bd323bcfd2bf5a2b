"""A frozen teacher scored by a vLLM engine in this process: top-k and token log-probs.

A teacher-pool worker (``cluster.teacher.engine: vllm``) holds one. vLLM's ``prompt_logprobs`` gives per position
the log-probs of the most likely next tokens and of the actual one, from the raw logits (temperature 1); tensor
parallelism (``tensor_parallel_size``) lets one worker hold a teacher larger than one GPU. The full-vocabulary signal
needs final hidden states, which vLLM does not return: that takes the HF engine. Answers are checked as a served
teacher's are (:mod:`opd.teachers.served.openai_protocol`).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from typing import Any, Literal

import torch
from pydantic import Field

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.gguf_source import gguf_source, load_gguf_causal_lm, load_gguf_tokenizer
from opd.models.interfaces import (
    FullVocabRequest,
    TeacherInterface,
    TeacherRequest,
    TeacherSignal,
    TokenLogprobsRequest,
    TopKLogprobs,
    TopKRequest,
)
from opd.models.tiny import TINY_PREFIX, build_tiny_model, is_tiny_path
from opd.teachers.served.openai_protocol import (
    ScoredSequence,
    fill_token_logprobs_from_scored,
    fill_topk_from_scored,
    placeholder_topk,
)
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError

FULL_VOCABULARY_REFUSAL = (
    "a vLLM teacher engine returns log-probs (top-k or each token's), not the final hidden states a "
    "full-vocabulary loss binds to the teacher's output layer; use loss_fn.type = topk or sampled_token with "
    "cluster.teacher.engine = vllm, or the HF engine (cluster.teacher.engine = hf) for the exact loss"
)


class VllmScoringConfig(StrictConfig):
    """The vLLM engine of a teacher pool worker (``cluster.teacher.vllm``)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engine's dtype; auto = the model config's"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="devices one teacher worker spreads the teacher over (vLLM tensor parallel; the worker gets "
        "that many GPUs)",
    )
    max_logprobs: int = Field(
        64, ge=1, description="the most candidates per position the engine returns: at least the top-k loss's k"
    )
    max_model_len: int | None = Field(None, ge=1, description="longest sequence; null = the model's")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="GPU only: share of each device the engine may take (weights + KV cache)"
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache bytes instead of gpu_memory_utilization's share; CPU default 256 MiB"
    )
    enforce_eager: Literal["auto"] | bool = Field(
        "auto", description="no CUDA graphs; auto = eager on CPU, graphs on GPU"
    )


def _model_directory(path: str, scratch: str) -> str:
    """A directory vLLM can load: ``path``, or a ``tiny:`` preset or GGUF model written to ``scratch``.

    GGUF is written dequantised: vLLM's reader would keep it quantised, unlike opd's other backends.
    """
    if is_tiny_path(path):
        build_tiny_model(path[len(TINY_PREFIX) :]).save_pretrained(scratch)
        return scratch
    if (source := gguf_source(path)) is not None:
        load_gguf_causal_lm(source, torch.float32).save_pretrained(scratch)
        load_gguf_tokenizer(source).save_pretrained(scratch)
        return scratch
    return path


def _scored(output: Any, sent: list[int]) -> ScoredSequence:
    """One vLLM request's ``prompt_logprobs`` as per-position ``{token: log-prob}`` (index 0: none)."""
    entries = output.prompt_logprobs
    if entries is None or len(entries) != len(sent):
        got = "none" if entries is None else len(entries)
        raise RuntimeError(f"the vLLM teacher returned {got} prompt log-prob entries for {len(sent)} tokens")
    candidates: list[dict[int, float]] = [{}]
    for position in range(1, len(sent)):
        scored = {int(token): float(info.logprob) for token, info in entries[position].items()}
        if not math.isfinite(scored.get(sent[position], math.nan)):
            raise RuntimeError(
                f"the vLLM teacher gave no finite log-prob for the token at position {position} ({sent[position]})"
            )
        candidates.append(scored)
    return ScoredSequence(candidates, None)


class VllmTeacher(TeacherInterface):
    """``TeacherInterface`` over an in-process vLLM engine; ``seed`` only makes the engine reproducible."""

    def __init__(self, model_path: str, config: VllmScoringConfig, on_gpu: bool, seed: int = 0) -> None:
        from opd.rollout.vllm_generation import configure_vllm_environment, engine_resources, import_vllm

        configure_vllm_environment(on_gpu)
        vllm = import_vllm()
        self._sampling_params_class = vllm.SamplingParams
        self.max_logprobs = config.max_logprobs
        self._scratch = tempfile.mkdtemp(prefix="opd-vllm-teacher-")
        engine_args: dict[str, Any] = {
            "model": _model_directory(model_path, self._scratch),
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "dtype": config.dtype,
            "seed": seed,
            "max_logprobs": config.max_logprobs,
            # Every request scores a whole new sequence: nothing to reuse across them.
            "enable_prefix_caching": False,
            **engine_resources(config, on_gpu),
        }
        try:
            self.llm = vllm.LLM(**engine_args)
        except Exception:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise

    @classmethod
    def unsupported_reason(cls, request: TeacherRequest) -> str | None:
        """The full-vocabulary signal: vLLM returns log-probs, not hidden states."""
        if isinstance(request, FullVocabRequest):
            return FULL_VOCABULARY_REFUSAL
        if isinstance(request, TopKRequest) and request.temperature != 1.0:
            return (
                f"a vLLM teacher engine scores at temperature 1 (the raw logits), not {request.temperature}; "
                "set loss_fn.temperature = 1"
            )
        return None

    def refusal(self, request: TeacherRequest) -> str | None:
        """Also a top-k ``k`` above the engine's ``max_logprobs``."""
        reason = super().refusal(request)
        if reason is None and isinstance(request, TopKRequest) and request.k > self.max_logprobs:
            return (
                f"loss_fn.k = {request.k} is more than the vLLM teacher engine returns per position "
                f"(cluster.teacher.vllm.max_logprobs = {self.max_logprobs}); raise max_logprobs"
            )
        return reason

    def score(self, data: BatchedDataDict, request: TeacherRequest) -> TeacherSignal:
        """Answers a top-k or token-log-prob ``request`` for ``data`` (CPU tensors); ConfigError where refused."""
        reason = self.refusal(request)
        if reason is not None:
            raise ConfigError(reason)
        input_ids, lengths = data["input_ids"], data["input_lengths"]
        sequences = [input_ids[row, : int(lengths[row])].tolist() for row in range(input_ids.shape[0])]
        k = request.k if isinstance(request, TopKRequest) else 0
        answers = self._prompt_logprobs(sequences, k)
        if isinstance(request, TopKRequest):
            values, ids, rest = placeholder_topk(input_ids.shape[0], input_ids.shape[1], k)
            fill_topk_from_scored(answers, k, values, ids, rest)
            return TopKLogprobs(values.float(), ids, rest.float())
        assert isinstance(request, TokenLogprobsRequest)
        result = torch.zeros(input_ids.shape, dtype=torch.float32)
        fill_token_logprobs_from_scored(answers, input_ids, result)
        return result

    def _prompt_logprobs(self, sequences: list[list[int]], k: int) -> list[ScoredSequence]:
        # One new token per request (vLLM must generate at least one); only the prompt's log-probs are read.
        params = self._sampling_params_class(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
        return [_scored(output, sent) for output, sent in zip(outputs, sequences, strict=True)]

    def close(self) -> None:
        """Shuts the engine down and removes its scratch directory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
        shutil.rmtree(self._scratch, ignore_errors=True)
