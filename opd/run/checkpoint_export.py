"""``opd export CHECKPOINT DIR``: a Hugging Face model directory from any checkpoint.

``policy/`` is copied; a cluster run's ``policy_shards/`` are read in this one process (no process group, any number
of writer ranks) into a model built from ``model_config/``. The output gets its final name only when complete.
GGUF export is :func:`opd.models.gguf_source.export_gguf`.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from opd.run.checkpoint import staging_directory
from opd.utils.errors import OpdError

POLICY_DIR = "policy"
SHARDS_DIR = "policy_shards"
MODEL_CONFIG_DIR = "model_config"
TOKENIZER_DIR = "tokenizer"


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> Path:
    """Writes the student of ``checkpoint`` to ``output`` as a Hugging Face model directory.

    Raises:
        OpdError: ``checkpoint`` is not an opd checkpoint, or ``output`` exists already.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    if output.exists():
        raise OpdError(f"opd export: {output} exists already; choose a new directory")
    staging = staging_directory(output)
    if not (checkpoint / "save_state.json").is_file():
        raise OpdError(
            f"opd export: {checkpoint} is not a complete opd checkpoint (no save_state.json); "
            "pass a step_N directory of a run's checkpoint_dir, or a GGUF model"
        )
    if (checkpoint / POLICY_DIR).is_dir():
        shutil.copytree(checkpoint / POLICY_DIR, staging)
    elif (checkpoint / SHARDS_DIR).is_dir():
        _consolidate(checkpoint, staging)
    else:
        raise OpdError(f"opd export: {checkpoint} holds neither {POLICY_DIR}/ nor {SHARDS_DIR}/")
    staging.rename(output)
    return output


def _consolidate(checkpoint: Path, staging: Path) -> None:
    """The sharded student loaded whole in this process and saved with its tokenizer."""
    config = AutoConfig.from_pretrained(str(checkpoint / MODEL_CONFIG_DIR))
    dtype = config.dtype
    # The shards hold fp32 master weights; the model is written in the run's model.dtype.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The shards hold the trainer's state dict under "model."; a tied head may be absent.
    state = model.state_dict()
    targets = {f"model.{name}": tensor for name, tensor in state.items()}
    stored = set(dcp.FileSystemReader(str(checkpoint / SHARDS_DIR)).read_metadata().state_dict_metadata)
    weights = [name for name in stored if name.startswith("model.")]
    if weights and all(".lora_A." in name or ".lora_B." in name for name in weights):
        raise OpdError(
            f"opd export: {checkpoint / SHARDS_DIR} holds a LoRA student's adapters only, not the base weights "
            "(the run's model.student_model_path); use the run's final_model/ (merged), or load the base model "
            "with peft and the adapter in final_model/adapter/"
        )
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [name for name in targets if name not in stored and not (tied and name == "model.lm_head.weight")]
    if missing:
        raise OpdError(f"opd export: {checkpoint / SHARDS_DIR} lacks {len(missing)} weights, e.g. {missing[:3]}")
    loaded = {name: tensor for name, tensor in targets.items() if name in stored}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=str(checkpoint / SHARDS_DIR), no_dist=True)
    model.to(dtype)
    model.save_pretrained(str(staging), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(checkpoint / TOKENIZER_DIR)).save_pretrained(str(staging))
