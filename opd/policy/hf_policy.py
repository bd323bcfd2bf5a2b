"""The student that trains: one optimizer step's parts, and :class:`HFPolicy`, the in-process student.

The FSDP2 trainer workers (:mod:`opd.distributed.trainer_worker`) build their step from the same functions
(optimizer and schedule, micro-batch plan, student output, gradient accumulation and application), so a run on
N workers and a run in one process differ only in where the gradients are summed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from opd.data.batched_data_dict import BatchedDataDict, token_budget_groups
from opd.data.sequences import model_inputs, pack_padding_free, shift_token_mask
from opd.models.config import LoraConfig, OptimizerConfig
from opd.models.interfaces import LossFunction, PolicyInterface, TeacherComparison, TeacherSignal, TeacherSignalFn
from opd.models.lm_head import LMHeadInput, final_hidden_states, output_layer_of
from opd.models.step_metrics import MetricValue, accumulate_metrics, read_metrics
from opd.policy.lora import (
    adapter_parameters,
    initialise_adapters,
    load_adapter_state,
    merged_tensors,
    wrap_with_lora,
)
from opd.utils.config import resolve_auto
from opd.utils.errors import OpdError
from opd.utils.timer import Timer

if TYPE_CHECKING:  # annotations only: importing it loads transformers' modeling stack (seconds)
    from transformers import PreTrainedModel

# Devices with a fused AdamW kernel in torch ≥ 2.4 (CPU included).
_FUSED_ADAM_DEVICES = ("cpu", "cuda", "xpu", "mps")


def adam_kernel_kwargs(implementation: str, params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """``torch.optim.AdamW`` keyword arguments for the chosen kernel; ``auto``: fused wherever it exists.

    The fused kernel updates all parameters in one pass: much faster on CPU for a student with a large embedding.
    """
    fusable = all(p.device.type in _FUSED_ADAM_DEVICES and p.is_floating_point() for p in params)
    implementation = resolve_auto(implementation, lambda: "fused" if fusable else "foreach")
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on biases and norms (the usual transformer recipe)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.dim() < 2 or "norm" in name.lower() else decay).append(param)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        **adam_kernel_kwargs(config.adam_implementation, decay + no_decay),
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int) -> Any:
    """The learning-rate schedule ``config.lr_scheduler`` names, over ``total_steps`` optimizer steps."""
    # Imported here: transformers' scheduler module imports peft, slow and needed only by processes that train.
    from transformers import get_scheduler

    return get_scheduler(
        config.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=config.warmup_steps,
        num_training_steps=max(total_steps, 1),
    )


def plan_micro_batches(
    data: BatchedDataDict, micro_batch_size: int, micro_batch_tokens: int | None = None
) -> list[BatchedDataDict]:
    """``data`` cut into micro-batches, each trimmed to its own longest row (padding costs compute).

    Rows are sorted longest first before they are cut, so that rows of like length share a micro-batch and pad
    each other little: with ``micro_batch_tokens``, up to that budget of padded tokens each; otherwise
    ``micro_batch_size`` rows each and a remainder (:func:`cut_longest_first`). The loss is
    normalised over the whole batch and each row's teacher signal is found by its ``sample_index``, so the order
    changes only the order in which the gradients are summed. A batch that is one micro-batch keeps its order.
    """
    lengths = data["input_lengths"].tolist()  # the step's one read of the batch
    planned = []
    for rows in micro_batch_groups(lengths, micro_batch_size, micro_batch_tokens):
        chunk = data.slice(rows.start, rows.stop) if isinstance(rows, range) else data.select_indices(rows)
        width, padded = max(lengths[row] for row in rows), chunk["input_ids"].shape[1]
        # Only per-position fields are trimmed; per-row ones ([B, teachers] weights) keep their width.
        planned.append(
            BatchedDataDict({k: v[:, :width] if _per_position(k, v, padded) else v for k, v in chunk.items()})
        )
    return planned


def micro_batch_groups(
    lengths: list[int], micro_batch_size: int, micro_batch_tokens: int | None = None
) -> Sequence[Sequence[int]]:
    """The rows of each micro-batch of :func:`plan_micro_batches`, from the rows' lengths alone.

    ``opd plan`` cuts a sample of the training data's lengths with it (:mod:`opd.plan.padding`).
    """
    if micro_batch_tokens is not None:
        return token_budget_groups(lengths, micro_batch_tokens)
    if micro_batch_size < len(lengths):
        return cut_longest_first(lengths, micro_batch_size)
    return [range(len(lengths))] if lengths else []


def student_output(
    model: PreTrainedModel,
    micro_batch: BatchedDataDict,
    device: torch.device,
    fused_lm_head: bool,
    hidden_states: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor | LMHeadInput:
    """The student's logits, or (fused loss) its final hidden states and output head.

    The fused head carries the architecture's logit transform (Gemma 2's soft cap, a logit scale), which the
    fused loss applies and differentiates. ``hidden_states`` runs the decoder alone (default
    :func:`final_hidden_states`; an FSDP2 student passes the method its hooks are registered on).
    """
    inputs = model_inputs(micro_batch, device)
    if fused_lm_head:
        run_decoder = hidden_states if hidden_states is not None else lambda **kw: final_hidden_states(model, **kw)
        hidden = run_decoder(**inputs)
        # Read after the forward: an FSDP2 head is whole only once it has run.
        return output_layer_of(model, "the student").trained_over(hidden)
    return model(**inputs, use_cache=False).logits


def accumulate_gradients(
    micro_batches: Iterable[BatchedDataDict],
    device: torch.device,
    forward: Callable[[BatchedDataDict, bool], torch.Tensor | LMHeadInput],
    loss_fn: LossFunction,
    teacher_answer: Callable[[int, BatchedDataDict], TeacherSignal | None],
    global_valid_tokens: int,
    global_valid_seqs: int,
    gradient_sync: Callable[[bool], None] | None = None,
) -> dict[str, MetricValue]:
    """Forward and backward over micro-batches, gradients accumulating; returns the loss's metrics summed, not read.

    The micro-batch loop of every trainer: the in-process student runs it over the whole batch, each FSDP2 rank
    over its share. Each micro-batch's loss is its share of the global mean (the global batch's valid tokens or
    sequences), so the summed gradients are the whole batch's. ``teacher_answer(index, micro_batch)`` is the
    teacher's signal (None: the loss needs none), asked with the micro-batch still where the batch came from (the
    host): a teacher that reads the tokens (prompt sharing, another tokenizer, a server) then reads no device.
    Micro-batches are moved to ``device`` here. Nothing is read from the device in the loop: the metrics stay 0-dim
    tensors until :func:`apply_gradients` reads them. ``gradient_sync(reduce)`` (a sharded student's
    ``set_requires_gradient_sync``) is told before each backward whether it is the step's last: the gradients are
    then reduced across ranks once per step, not once per micro-batch.
    """
    totals: dict[str, MetricValue] = {}
    micro_batches = list(micro_batches)
    for index, host_micro_batch in enumerate(micro_batches):
        teacher_output = teacher_answer(index, host_micro_batch)
        micro_batch = host_micro_batch.to(device)
        output = forward(micro_batch, loss_fn.fused_lm_head)
        loss, metrics = loss_fn.loss_and_metrics(
            output, micro_batch, global_valid_tokens, global_valid_seqs, teacher_output=teacher_output
        )
        if gradient_sync is not None:
            gradient_sync(index == len(micro_batches) - 1)
        loss.backward()
        del teacher_output, output  # freed before the next micro-batch's forward
        accumulate_metrics(totals, metrics)
    return totals


_PER_ROW_MATRICES = ("teacher_weights",)
"""``[B, n]`` batch fields that are not laid out by position (a mixture's weight of each teacher)."""


def cut_longest_first(lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """The rows by length, longest first (ties keep their order), cut into consecutive micro-batches of
    ``micro_batch_size`` rows and one smaller remainder, placed where it pads the least.

    A micro-batch pads every row to its longest, so it costs its rows × its longest row. Some cut into consecutive
    runs of the sorted rows pads the least of any grouping into these sizes (the group holding the longest row
    loses nothing by taking the next longest ones too); which one depends only on where the remainder goes.
    """
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])  # sorted() is stable
    full, remainder = divmod(len(order), micro_batch_size)
    choices = [[micro_batch_size] * full]
    if remainder:
        choices = [[micro_batch_size] * at + [remainder] + [micro_batch_size] * (full - at) for at in range(full + 1)]

    def padded(sizes: list[int]) -> int:
        starts = itertools.accumulate(sizes[:-1], initial=0)
        return sum(size * lengths[order[start]] for size, start in zip(sizes, starts, strict=True))

    sizes = min(choices, key=padded)
    starts = itertools.accumulate(sizes[:-1], initial=0)
    return [order[start : start + size] for size, start in zip(sizes, starts, strict=True)]


def _per_position(key: str, value: object, padded_width: int) -> bool:
    return (
        key not in _PER_ROW_MATRICES
        and isinstance(value, torch.Tensor)
        and value.dim() == 2
        and value.shape[1] == padded_width
    )


def global_grad_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """The L2 norm of all gradients together; a sharded (DTensor) norm is reduced over the ranks first."""
    gradients = [param.grad for param in parameters if param.grad is not None]
    if not gradients:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm(gradients)
    full_tensor = getattr(norm, "full_tensor", None)  # FSDP2 gradients are DTensors
    return full_tensor() if full_tensor is not None else norm


def apply_gradients(
    parameters: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    max_grad_norm: float | None,
    totals: dict[str, MetricValue],
) -> dict[str, float]:
    """Clips and applies the accumulated gradients, unless the loss or gradient is NaN/inf.

    A non-finite step would poison the weights and Adam's moments for good, so it is skipped entirely (no optimizer
    or schedule step). ``max_grad_norm`` None: no clipping. Returns ``totals`` (the summed loss metrics) plus
    ``grad_norm`` (before clipping), ``lr`` (used for this step) and ``skipped_nonfinite`` (1.0 if skipped), read
    from the device together: the step's one host sync for its metrics.
    """
    with_grad = [param for param in parameters if param.grad is not None]
    grad_norm = global_grad_norm(with_grad)
    metrics = read_metrics({**totals, "grad_norm": grad_norm})
    metrics["lr"] = scheduler.get_last_lr()[0]
    finite = math.isfinite(metrics.get("loss", 0.0)) and math.isfinite(metrics["grad_norm"])
    metrics["skipped_nonfinite"] = 0.0 if finite else 1.0
    if finite:
        if max_grad_norm is not None and with_grad:
            torch.nn.utils.clip_grads_with_norm_(with_grad, max_grad_norm, grad_norm)
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics


ADAPTER_DIR = "adapter"
"""Where :meth:`HFPolicy.save_pretrained` puts a LoRA student's adapter (peft's format)."""


class HFPolicy(PolicyInterface):
    """``PolicyInterface`` for an in-process ``PreTrainedModel``, trained in place.

    Args:
        micro_batch_tokens: if set, replaces ``micro_batch_size`` (:func:`plan_micro_batches`).
        sequence_packing: each micro-batch's sequences in one row without padding (same loss).
        lora: LoRA settings (:mod:`opd.policy.lora`), or None to train every weight. ``model`` gets its adapters
            in place (whatever else holds it, e.g. the HF generation engine, samples with the current adapter)
            and its base weights are frozen.
        seed: seeds a LoRA student's starting adapter (the FSDP2 trainer starts from the same one).
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
        """One optimizer step over ``data``, the whole right-padded global batch; returns its metrics.

        The valid tokens of the whole batch are counted first, so the loss normalises globally and gradient
        accumulation is exact. ``teacher_signal`` is None for losses without a teacher (SFT); ``timer`` is
        unused (the driver times every phase of an in-process step).
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
        """Sums of ``comparison`` over :meth:`train`'s micro-batches, unpacked (see :class:`PolicyInterface`).

        The student is given as final hidden states and output layer, so the comparison makes logits chunk by chunk.
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
        """Every parameter by name, detached; a LoRA student's merged under the base names (a plain model)."""
        if self.lora is not None:
            yield from merged_tensors(self.model, self.model.named_parameters())
            return
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer and LR-schedule state, plus a LoRA student's adapter weights.

        A LoRA run resumes from the base model and these exact adapter tensors: the merged weights of its model
        directory are not the base weights plus the adapter bit for bit.
        """
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.lora is not None:
            state["lora_adapter"] = {name: param.detach() for name, param in adapter_parameters(self.model).items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned; OpdError if the checkpoint and ``model.lora`` disagree on LoRA."""
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

        A LoRA student is written merged into a plain model (no peft keys) and as the adapter alone in
        ``directory/adapter/`` (peft's format, for ``PeftModel.from_pretrained(base, ...)``).
        """
        if self.peft_model is None:
            self.model.save_pretrained(directory, safe_serialization=True)
        else:
            merged = dict(merged_tensors(self.model, self.model.state_dict().items()))
            self.model.save_pretrained(directory, state_dict=merged, safe_serialization=True)
            self.peft_model.save_pretrained(str(Path(directory) / ADAPTER_DIR), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
