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
        student_output: Any,
        data: dict[str, Any],
        global_valid_tokens: int,
        global_valid_seqs: int,
        teacher_output: Any = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns the loss (already divided by the global normaliser) and metrics.

        ``student_output`` is the student's ``[B, L, V]`` logits, or, when the loss sets
        ``fused_lm_head = True``, an :class:`~opd.algorithms.fused_lm_head.LMHeadInput`
        (hidden states and head) from which it makes the logits chunk by chunk.
        ``teacher_output`` is whatever the loss's ``query_teacher`` asked the teacher for.

        Metrics are likewise global-normalised contributions, so the trainer sums them
        over micro-batches to get global-batch values.
        """
        ...
