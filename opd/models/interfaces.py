"""Interfaces between the distillation driver and its backends.

``distillation_train`` talks only to these protocols, never to a concrete backend, as in
NeMo-RL. The embedded backends (HF models in one process) implement them today; vLLM
generation, served teachers and Ray worker groups implement the same methods later, so
the driver does not change.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from opd.data.batched_data_dict import BatchedDataDict


class GenerationInterface(Protocol):
    """Samples responses from the student."""

    needs_refit: bool
    """True when the engine holds its own copy of the weights (e.g. vLLM) that must be
    refreshed after each optimizer step; False when it generates with the trained model."""

    def prepare_for_generation(self) -> None:
        """Switches the engine on (eval mode, wake from sleep, ...)."""

    def finish_generation(self) -> None:
        """Releases what generation held (train mode, sleep, ...)."""

    def generate(
        self, prompts: list[list[int]], strategy: Any, num_samples: int, return_logprobs: bool = True
    ) -> BatchedDataDict:
        """Samples ``num_samples`` responses per prompt.

        ``return_logprobs=False`` tells the engine that nobody needs the sampler's
        log-probs (the batch then has no ``generation_logprobs``), so it may skip them.

        Returns:
            A batch of ``len(prompts) * num_samples`` rows (samples of one prompt are
            adjacent) with right-padded ``input_ids [N, L]`` (prompt + response),
            ``input_lengths [N]``, ``prompt_lengths [N]``, ``response_lengths [N]``,
            ``generation_logprobs [N, L]`` (the sampler's log-prob of each response
            token at that token's position, 0 elsewhere) and ``truncated [N]`` (no EOS).
        """
        ...


class TeacherInterface(Protocol):
    """A frozen model that scores the student's tokens."""

    def get_logits(self, data: BatchedDataDict) -> torch.Tensor:
        """Full-vocabulary logits ``[B, L, V]`` for ``data["input_ids"]`` (no gradient)."""
        ...

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k log-probs and ids ``([B, L, k], [B, L, k])``; position t describes token t + 1."""
        ...

    def get_token_logprobs(self, data: BatchedDataDict, vocab_size: int | None = None) -> torch.Tensor:
        """``[B, L]`` log-prob of each token given the tokens before it (0 at position 0)."""
        ...


class PolicyInterface(Protocol):
    """The trainable student."""

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        teacher_logits_fn: Callable[[BatchedDataDict], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Runs forward/backward over micro-batches and one optimizer step; returns metrics."""
        ...

    def save_pretrained(self, directory: str) -> None:
        """Writes the student as a Hugging Face model directory."""
        ...
