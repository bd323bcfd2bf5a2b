"""The supervised loss: negative log-likelihood of the response tokens (supervised fine-tuning)."""

from __future__ import annotations

from typing import Any

import torch

from opd.losses.distillation_losses import LossInputs, TokenLossFn, loss_rows
from opd.models.lm_head import token_log_probs


class NLLLossFn(TokenLossFn):
    """Negative log-likelihood −log Q(next token) of the masked tokens; it asks the teacher for nothing.

    Arguments, normalisation and the fused path are :class:`TokenLossFn`'s.
    """

    def _loss_inputs(
        self, teacher_output: Any, data: dict[str, Any], loss_mask: torch.Tensor, fused: bool
    ) -> LossInputs:
        """The next token of each loss position (``teacher_output`` is ignored)."""
        return LossInputs((loss_rows(data["input_ids"], loss_mask, shift=1),))

    def _divergence(self, student_logits: torch.Tensor, *row_inputs: Any) -> torch.Tensor:
        (targets,) = row_inputs
        compute_dtype = torch.promote_types(student_logits.dtype, torch.float32)
        return -token_log_probs(torch.log_softmax(student_logits.to(compute_dtype), dim=-1), targets)
