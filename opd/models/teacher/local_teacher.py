"""A frozen teacher that runs in the trainer's process.

It scores exactly the token ids it is given, in ``torch.inference_mode``. Its
full-vocabulary logits are produced one micro-batch at a time, when the student's
trainer asks for them, so at most one micro-batch of ``[B, L, V]`` teacher logits is
alive at once.
"""

from __future__ import annotations

import time

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import attention_mask_from_lengths


class LocalTeacher:
    """``TeacherInterface`` over an in-process, frozen ``PreTrainedModel``.

    Args:
        model: the teacher; it is switched to eval mode with gradients off.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        self.seconds_spent = 0.0
        """Wall time spent scoring since the last :meth:`pop_seconds_spent`."""

    def get_logits(self, data: BatchedDataDict) -> torch.Tensor:
        """Teacher logits ``[B, L, V]`` for right-padded ``data["input_ids"]``."""
        start = time.perf_counter()
        device = next(self.model.parameters()).device
        input_ids = data["input_ids"].to(device)
        attention_mask = attention_mask_from_lengths(data["input_lengths"].to(device), input_ids.shape[1])
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        # Inference-mode tensors cannot be saved for the student's backward pass; a clone
        # made outside inference mode is an ordinary constant tensor.
        logits = logits.clone()
        self.seconds_spent += time.perf_counter() - start
        return logits

    def pop_seconds_spent(self) -> float:
        """Returns the scoring time accumulated so far and resets the counter."""
        seconds, self.seconds_spent = self.seconds_spent, 0.0
        return seconds
