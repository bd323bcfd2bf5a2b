"""Which models to load and how (the ``model`` section), and the optimizer.

The ``teacher`` and ``teachers`` sections are in :mod:`opd.teachers.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from opd.utils.config import StrictConfig

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Qwen2 / Llama-style decoders."""

# Layers the fused loss and the merged refit read directly: an adapter there would be skipped.
_FORBIDDEN_LORA_TARGETS = ("lm_head", "embed_tokens")


class ModelLoadingConfig(StrictConfig):
    """How models are loaded, shared by every algorithm's ``model`` section."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] | None = Field(
        "auto",
        description="auto: flash_attention_2 for a 16-bit model on CUDA where the flash_attn package is installed "
        "(packed rows, training.sequence_packing, then run its variable-length kernel), else transformers' default, "
        "sdpa (packed rows get a block-diagonal mask); null: transformers' default",
    )
    tf32: bool = Field(
        True,
        description="on CUDA, float32 matmuls (the fused loss's fp32 accumulations, a float32 model) run on TF32 "
        "tensor cores, in every process that loads a model; false keeps them in full float32 (no effect on CPU)",
    )


class LoraConfig(StrictConfig):
    """Low-rank adapters on the student (``model.lora``), trained with ``peft`` instead of the full weights.

    Giving the section (even one key, e.g. ``model.lora.r=8``) switches LoRA on; ``null`` (default) or
    ``enabled: false`` trains the full model.
    """

    enabled: bool = Field(True, description="false = full fine-tuning despite the section")
    r: int = Field(16, ge=1, description="rank of each adapter")
    alpha: float = Field(32.0, gt=0.0, description="scaling numerator: the update is (alpha / r) · B·A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter input during training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="module names (suffixes) that get adapters, or all-linear (every linear layer but the head)",
    )

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("needs at least one module name (or all-linear)")
        forbidden = sorted(set(value) & set(_FORBIDDEN_LORA_TARGETS))
        if forbidden:
            raise ValueError(
                f"{forbidden} cannot take an adapter: the fused loss and the merged refit read the embedding and "
                "output layers' weights directly"
            )
        return value


class StudentLoraSettings(StrictConfig):
    """The ``lora`` key of a section that loads a trainable student."""

    lora: LoraConfig | None = Field(None, description="low-rank adapters (peft); null = full fine-tuning")

    def active_lora(self) -> LoraConfig | None:
        """The LoRA settings if LoRA is on (section given and ``enabled``), else None."""
        return self.lora if self.lora is not None and self.lora.enabled else None


class ModelConfig(ModelLoadingConfig, StudentLoraSettings):
    """Teacher, student and tokenizer locations plus loading options."""

    teacher_model_path: str | None = Field(
        None, description="teacher: hub name, local directory or tiny:<preset> (required unless teacher.backend=remote)"
    )
    student_model_path: str = Field(description="student: hub name, local directory or tiny:<preset>")
    tokenizer_path: str | None = Field(None, description="defaults to student_model_path")


class OptimizerConfig(StrictConfig):
    """AdamW and learning-rate schedule settings."""

    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="null disables clipping")
    warmup_steps: int = Field(0, ge=0)
    lr_scheduler: str = Field("constant_with_warmup", pattern="^(constant_with_warmup|linear|cosine)$")
    adam_implementation: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto", description="AdamW kernel: auto = fused where torch has it for the device, else foreach"
    )
