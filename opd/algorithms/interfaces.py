"""The loss-function protocol shared by every algorithm (distillation, SFT).

A loss function is called once per micro-batch. It receives the counts of valid tokens
and sequences in the *whole global batch*, so that it can normalise by them: the sum of
the micro-batch losses is then exactly the loss of one big batch, and gradient
accumulation changes nothing but memory.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LossFunction(Protocol):
    """Computes a micro-batch's share of the global-batch loss."""

    def __call__(
        self,
        student_logits: torch.Tensor,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns the loss (already divided by the global normaliser) and metrics.

        Metrics are likewise global-normalised contributions, so the trainer sums them
        over micro-batches to get global-batch values.
        """
        ...
