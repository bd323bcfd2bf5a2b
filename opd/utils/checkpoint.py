"""Crash-safe checkpoints: ``step_N/`` directories written under a temporary name.

Layout of one checkpoint::

    checkpoint_dir/step_N/
      policy/                 # the student as an HF model directory (safetensors + tokenizer);
                              # a LoRA student: merged weights, plus policy/adapter/ (peft)
      optimizer.pt            # optimizer + scheduler state (loaded with weights_only=True);
                              # a LoRA student's adapter tensors too (``lora_adapter``): its
                              # run resumes from the base model and these exact tensors
      training_state.pt       # RNG states and dataloader state (weights_only=True)
      save_state.json         # step, epoch, consumed samples, best metric
      config.yaml             # the resolved config of the run

A student trained by FSDP2 workers (a ``cluster:`` run) writes, instead of ``policy/``
and ``optimizer.pt``, its shards (:mod:`opd.distributed.trainer_worker`)::

      policy_shards/          # weights + optimizer, torch.distributed.checkpoint, one file per rank
      scheduler.pt            # the learning-rate schedule
      model_config/           # the student's config.json (for `opd export`)
      tokenizer/              # the run's tokenizer

A checkpoint is written to ``.tmp_step_N`` and renamed to ``step_N`` only when every file
is on disk, so a crash mid-write never leaves a directory that resume would pick.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from opd.utils.config import StrictConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointingConfig(StrictConfig):
    """When and where checkpoints are written."""

    enabled: bool = True
    checkpoint_dir: str = Field("checkpoints", description="directory holding step_N/ checkpoints")
    keep_top_k: int | None = Field(3, ge=1, description="newest checkpoints kept (plus the best); null keeps all")
    metric_name: str | None = Field(
        "val/kl_reverse", description="validation metric that picks the best checkpoint; null disables"
    )
    higher_is_better: bool = Field(False, description="whether a larger metric_name is better")
    save_on_signal: bool = Field(True, description="write a checkpoint when SIGINT/SIGTERM stops the run")


class CheckpointManager:
    """Writes, lists, prunes and loads ``step_N`` checkpoints.

    Args:
        config: the ``checkpointing`` config section.
    """

    def __init__(self, config: CheckpointingConfig) -> None:
        self.config = config
        self.root = Path(config.checkpoint_dir)
        self.protected_step: int | None = None
        """A step whose checkpoint pruning never deletes (the best one so far)."""

    def remove_incomplete(self) -> list[Path]:
        """Deletes temporary directories left by a write that was killed; returns them."""
        if not self.root.is_dir():
            return []
        leftovers = [child for child in self.root.iterdir() if child.name.startswith(".tmp_step_")]
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        return leftovers

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first (temporary dirs ignored)."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and child.is_dir() and (child / "save_state.json").is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        checkpoints = self.list_checkpoints()
        return checkpoints[-1][1] if checkpoints else None

    def save(
        self,
        step: int,
        policy: Any,
        tokenizer: Any,
        save_state: dict[str, Any],
        training_state: dict[str, Any],
        config_yaml: str,
    ) -> Path:
        """Writes ``step_<step>`` atomically and prunes old checkpoints.

        Args:
            step: optimizer step just completed.
            policy: has ``save_checkpoint(dir, tokenizer=...)`` (weights, optimizer and
                scheduler state; sharded for a distributed trainer).
            tokenizer: saved beside the model.
            save_state: JSON-serialisable run counters.
            training_state: tensors/containers (RNG, dataloader) saved with torch.save.
            config_yaml: the resolved config.

        Returns:
            The final checkpoint directory.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        staging = self.root / f".tmp_step_{step}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        policy.save_checkpoint(staging, tokenizer=tokenizer)
        torch.save(training_state, staging / "training_state.pt")
        (staging / "config.yaml").write_text(config_yaml, encoding="utf-8")
        # save_state.json marks completeness, so it is written last.
        (staging / "save_state.json").write_text(json.dumps(save_state, indent=2), encoding="utf-8")
        _fsync_tree(staging)
        if final.exists():  # re-saving the same step (e.g. after a resume)
            shutil.rmtree(final)
        os.replace(staging, final)
        self._prune()
        return final

    def _prune(self) -> None:
        """Deletes all but the newest ``keep_top_k`` checkpoints and the protected (best) one."""
        if self.config.keep_top_k is None:
            return
        for step, path in self.list_checkpoints()[: -self.config.keep_top_k]:
            if step != self.protected_step:
                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def load_save_state(checkpoint: Path) -> dict[str, Any]:
        """Reads ``save_state.json`` of a checkpoint."""
        return json.loads((checkpoint / "save_state.json").read_text(encoding="utf-8"))

    @staticmethod
    def load_training_state(checkpoint: Path) -> dict[str, Any]:
        """Reads RNG and dataloader state (``weights_only=True``: no arbitrary unpickling)."""
        return torch.load(checkpoint / "training_state.pt", weights_only=True)


def _fsync_tree(directory: Path) -> None:
    """Flushes every file under ``directory`` to disk before the rename publishes it."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
