"""The trainable student: a Hugging Face causal LM with its optimizer and schedule.

``train`` performs one optimizer step over a global batch: it counts the valid tokens of
the whole batch first, then runs forward/backward micro-batch by micro-batch (asking the
teacher for the same micro-batch's output when a teacher is given), so the loss
function can normalise globally and gradient accumulation is exact. For a fused loss
the student's forward stops at the final hidden states and the loss makes the logits
chunk by chunk.

With ``lora`` settings the student is wrapped with peft adapters
(:mod:`opd.policy.lora`): only the adapters are trained and held by AdamW, the
refit weights and ``final_model/`` are the merged plain model, the adapter is saved
beside them (``adapter/``) and in the checkpoint's optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import model_inputs, pack_padding_free, shift_token_mask
from opd.models.config import LoraConfig, OptimizerConfig
from opd.models.interfaces import LossFunction, PolicyInterface, TeacherComparison, TeacherSignal, TeacherSignalFn
from opd.models.lm_head import LMHeadInput, final_hidden_states, output_layer_of
from opd.policy.lora import (
    adapter_parameters,
    initialise_adapters,
    load_adapter_state,
    merged_tensors,
    wrap_with_lora,
)
from opd.policy.optimization import (
    accumulate_gradients,
    accumulate_metrics,
    apply_gradients,
    build_optimizer,
    build_scheduler,
    plan_micro_batches,
    student_output,
)
from opd.utils.errors import OpdError
from opd.utils.timer import Timer

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

ADAPTER_DIR = "adapter"
"""Where :meth:`HFPolicy.save_pretrained` puts a LoRA student's adapter (peft's format)."""


class HFPolicy(PolicyInterface):
    """``PolicyInterface`` for an in-process ``PreTrainedModel``.

    Args:
        model: the student (trained in place).
        optimizer_config: AdamW / schedule settings.
        micro_batch_size: sequences per forward/backward pass.
        total_steps: optimizer steps planned (for decaying schedules).
        micro_batch_tokens: if set, micro-batches are formed by this budget of padded
            tokens instead (length-sorted dynamic batching) and ``micro_batch_size`` is
            not used.
        sequence_packing: concatenate each micro-batch's sequences into one row without
            padding (:func:`~opd.data.sequences.pack_padding_free`); same loss.
        lora: LoRA settings, or None to train every weight. With LoRA, ``model`` gets its
            adapters in place (anything else holding it, e.g. the HF generation engine,
            samples with the current adapter) and its base weights are frozen.
        seed: seeds a LoRA student's starting adapter (:func:`~opd.policy.lora.initialise_adapters`:
            the FSDP2 trainer starts from the same one).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        optimizer_config: OptimizerConfig,
        micro_batch_size: int,
        total_steps: int,
        micro_batch_tokens: int | None = None,
        sequence_packing: bool = False,
        lora: LoraConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.lora = lora
        # The PeftModel around self.model: it saves the adapter; the forward runs on self.model.
        self.peft_model = wrap_with_lora(model, lora) if lora is not None else None
        if lora is not None:
            initialise_adapters(model, seed)
        self.model.train()
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.sequence_packing = sequence_packing
        self.config = optimizer_config
        self.optimizer = build_optimizer(model, optimizer_config)
        self.scheduler = build_scheduler(self.optimizer, optimizer_config, total_steps)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, micro_batch: BatchedDataDict, fused_lm_head: bool) -> torch.Tensor | LMHeadInput:
        """The student's logits, or (fused loss) its final hidden states and head."""
        return student_output(self.model, micro_batch, self.device, fused_lm_head)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: LossFunction,
        teacher_signal: TeacherSignalFn | None = None,
        timer: Timer | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``data`` (the whole global batch).

        Args:
            data: right-padded batch with ``input_ids``, ``input_lengths``, ``token_mask``.
            loss_fn: called per micro-batch; if it sets ``fused_lm_head`` it receives
                hidden states and the head, not logits.
            teacher_signal: the teacher's answer for a micro-batch (what the loss's
                ``teacher_request`` asks for); None for losses that need no teacher (SFT).
            timer: unused: every phase of an in-process step is timed by the driver.

        Returns:
            Global-batch metrics: the loss function's metrics summed over micro-batches,
            plus ``grad_norm`` (before clipping), ``lr`` (used for this step) and
            ``skipped_nonfinite`` (1 if the loss or gradient was NaN/inf and the step was
            skipped without touching the weights).
        """
        global_valid_tokens = int(shift_token_mask(data["token_mask"]).sum())
        global_valid_seqs = data.size
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = plan_micro_batches(data, self.micro_batch_size, self.micro_batch_tokens)
        if self.sequence_packing:
            micro_batches = [pack_padding_free(micro_batch) for micro_batch in micro_batches]

        def teacher_answer(index: int, micro_batch: BatchedDataDict) -> TeacherSignal | None:
            return teacher_signal(micro_batch) if teacher_signal is not None else None

        totals = accumulate_gradients(
            micro_batches, self.device, self._forward, loss_fn, teacher_answer, global_valid_tokens, global_valid_seqs
        )
        parameters = [param for param in self.model.parameters() if param.requires_grad]
        return apply_gradients(parameters, self.optimizer, self.scheduler, self.config.max_grad_norm, totals)

    def get_logits(self, data: BatchedDataDict) -> torch.Tensor:
        """``[B, L, V]`` logits of right-padded ``data["input_ids"]``, in inference mode (tests, tools)."""
        with torch.inference_mode():
            return self.model(**model_inputs(data, self.device), use_cache=False).logits

    def compare_with_teacher(
        self, data: BatchedDataDict, comparison: TeacherComparison, teacher_signal: TeacherSignalFn
    ) -> dict[str, float]:
        """Sums of ``comparison`` over ``data``, micro-batch by micro-batch (see :class:`PolicyInterface`).

        The micro-batches are those of :meth:`train` (unpacked); each one's student is its
        final hidden states and output layer, so the comparison makes the logits chunk by chunk.
        """
        totals: dict[str, float] = {}
        for micro_batch in plan_micro_batches(data, self.micro_batch_size, self.micro_batch_tokens):
            micro_batch = micro_batch.to(self.device)
            teacher_output = teacher_signal(micro_batch)
            with torch.inference_mode():
                hidden = final_hidden_states(self.model, **model_inputs(micro_batch, self.device))
                # The head with its logit transform, if any: nothing is differentiated here.
                student = output_layer_of(self.model, "the student").over(hidden)
                accumulate_metrics(totals, comparison(student, teacher_output, micro_batch))
        return totals

    def weights_for_refit(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter by name, detached (the engine copies them).

        A LoRA student yields the merged weights under the base model's names, so the
        engine sees a plain model.
        """
        if self.lora is not None:
            yield from merged_tensors(self.model, self.model.named_parameters())
            return
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer and LR-schedule state, plus a LoRA student's adapter weights.

        A full fine-tuning run's weights are saved as an HF model directory; a LoRA run
        resumes from the base model and these adapter tensors (exact copies), because the
        merged weights of its model directory are not the base weights plus the adapter
        bit for bit.
        """
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.lora is not None:
            state["lora_adapter"] = {name: param.detach() for name, param in adapter_parameters(self.model).items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            OpdError: a LoRA checkpoint restored without ``model.lora``, or the reverse.
        """
        if (self.lora is not None) != ("lora_adapter" in state):
            written = "with" if "lora_adapter" in state else "without"
            raise OpdError(
                f"the checkpoint was written {written} model.lora and this run is configured "
                f"{'with' if self.lora is not None else 'without'} it; resume with the run's own model.lora setting"
            )
        if self.lora is not None:
            load_adapter_state(self.model, state["lora_adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_pretrained(self, directory: str, tokenizer: Any | None = None) -> None:
        """Writes the student (safetensors) and optionally its tokenizer to ``directory``.

        A LoRA student is written twice: merged into a plain model in ``directory``
        (loadable with ``AutoModelForCausalLM.from_pretrained``, no peft keys) and as the
        adapter alone in ``directory/adapter/`` (peft's ``adapter_config.json`` and
        ``adapter_model.safetensors``, for ``PeftModel.from_pretrained(base, ...)``).
        """
        if self.peft_model is None:
            self.model.save_pretrained(directory, safe_serialization=True)
        else:
            merged = dict(merged_tensors(self.model, self.model.state_dict().items()))
            self.model.save_pretrained(directory, state_dict=merged, safe_serialization=True)
            self.peft_model.save_pretrained(str(Path(directory) / ADAPTER_DIR), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
