"""Rollout workers: engines that sample from the student, refit from the trainer in buckets.

:class:`RolloutWorker` is one Ray actor holding its own engine over a copy of the
student: :class:`~opd.models.generation.hf_generation.HFGeneration`, or with
``generation.backend: vllm`` a :class:`~opd.models.generation.vllm_generation.VllmGeneration`
engine (one per worker, in the worker's process).
:class:`RayGeneration` is the ``GenerationInterface`` the driver sees:

* ``generate`` deals the prompts to the workers in contiguous blocks (each prompt's
  samples stay together on one worker) and concatenates the answers in prompt order.
  Each call draws one seed from the controller's torch generator (which checkpoints
  save and resume restores) and worker ``r`` samples with ``seed + r``, so the rollouts
  are the same for a given seed, across a resume too;
* ``refit`` moves the trainer's new weights after each update: rank 0 of the trainer
  gathers them into buckets of ``cluster.rollout.refit_bucket_mb`` in Ray's object
  store (shared memory on one node) and every worker loads the buckets in place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import ray
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.distributed.refit_buckets import put_in_buckets
from opd.distributed.worker_group import WorkerGroup
from opd.models.config import ModelLoadingConfig
from opd.models.generation.config import GenerateStrategyConfig, VllmGenerationConfig
from opd.models.generation.hf_generation import HFGeneration
from opd.models.interfaces import GenerationInterface, Pending, PolicyInterface
from opd.models.loading import load_causal_lm, resolve_device, resolve_dtype
from opd.utils.errors import WorkerError

_SEED_RANGE = 2**31 - 1


@dataclass(frozen=True)
class RolloutSpec:
    """What every rollout worker builds.

    Attributes:
        model_path: the student's starting weights (refit replaces them before sampling).
        loading: dtype and loading options.
        tokenizer: the run's tokenizer.
        decode_loop: ``opd`` or ``generate`` (see ``generation.decode_loop``).
        stop_ids: token ids that end a response (None: the model's own).
        threads: torch threads of a CPU worker.
        vllm: the vLLM engine's settings, or None for the HF engine.
        seed: the vLLM engine's seed (each worker adds its rank).
    """

    model_path: str
    loading: ModelLoadingConfig
    tokenizer: Any
    decode_loop: str
    stop_ids: tuple[int, ...] | None
    threads: int
    vllm: VllmGenerationConfig | None = None
    seed: int = 0


class RolloutWorker:
    """One rollout engine (a Ray actor): the student's weights and an HF sampler.

    Args:
        rank: this worker's rank among the rollout workers.
        spec: what to build.
    """

    def __init__(self, rank: int, spec: RolloutSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.rank = rank
        device = resolve_device(spec.loading.device)
        model = load_causal_lm(spec.model_path, resolve_dtype(spec.loading.dtype, device), device, spec.loading)
        model.requires_grad_(False)
        self.model = model
        self.vllm_engine: Any = None
        self.engine: GenerationInterface
        if spec.vllm is not None:
            # Imported here: vLLM is optional, and only its rollout workers need it.
            from opd.models.generation.vllm_generation import VllmGeneration

            self.vllm_engine = VllmGeneration(model, spec.tokenizer, spec.vllm, spec.seed + rank, spec.stop_ids)
            self.engine = self.vllm_engine
        else:
            self.engine = HFGeneration(model, spec.tokenizer, spec.decode_loop, stop_ids=spec.stop_ids)

    def load_buckets(self, bucket_refs: list[Any]) -> int:
        """Copies the trainer's weights into this worker's engine, bucket by bucket; returns the tensors loaded.

        The HF engine samples with the worker's model, which takes the tensors in place; a
        vLLM engine takes them through its own weight loader.
        """
        own = self.model.state_dict()
        pairs = []
        for ref in bucket_refs:
            for name, tensor in ray.get(ref).items():
                if self.vllm_engine is not None:
                    pairs.append((name, tensor.to(own[name].dtype)))
                else:
                    own[name].copy_(tensor)
                    pairs.append((name, own[name]))
        if self.vllm_engine is not None:
            self.vllm_engine.load_weights(pairs)
        return len(pairs)

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int,
        return_logprobs: bool,
        seed: int,
    ) -> BatchedDataDict:
        """Samples ``num_samples`` responses to each of ``prompts`` with the torch seed ``seed + rank``."""
        torch.manual_seed(seed + self.rank)
        self.engine.prepare_for_generation()
        try:
            return self.engine.generate(prompts, strategy, num_samples, return_logprobs)
        finally:
            self.engine.finish_generation()

    def close(self) -> None:
        """Frees the engine (a vLLM engine's scratch files and memory)."""
        self.engine.close()


class RayGeneration(GenerationInterface):
    """``GenerationInterface`` over a :class:`WorkerGroup` of :class:`RolloutWorker` (see the module docstring).

    Args:
        workers: the rollout workers.
        pad_token_id: pads the concatenated batch.
        refit_bucket_bytes: size of one refit bucket.
    """

    needs_refit = True

    def __init__(self, workers: WorkerGroup, pad_token_id: int, refit_bucket_bytes: int) -> None:
        self.workers = workers
        self.pad_token_id = pad_token_id
        self.refit_bucket_bytes = refit_bucket_bytes

    def prepare_for_generation(self) -> None:
        """Nothing to switch on: the workers sample in eval mode on every call."""

    def finish_generation(self) -> None:
        """Nothing to release: HF workers keep their weights for the next refit."""

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """The workers' samples, in prompt order (see ``GenerationInterface.generate``)."""
        return self.generate_async(prompts, strategy, num_samples, return_logprobs).result()

    def generate_async(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> Pending[BatchedDataDict]:
        """Hands each worker its share of the prompts and returns while they sample.

        The sampling seed is drawn here, from the controller's torch generator, so a
        rollout depends on when it was asked for, not on when it is collected.
        """
        seed = int(torch.randint(_SEED_RANGE, (1,)))
        count = min(self.workers.size, len(prompts))
        bounds = [len(prompts) * rank // count for rank in range(count + 1)]
        refs = [
            self.workers.actors[rank].generate.remote(
                prompts[bounds[rank] : bounds[rank + 1]], strategy, num_samples, return_logprobs, seed
            )
            for rank in range(count)
        ]
        return self.workers.pending(refs, self._concat, ranks=list(range(count)), what="generate")

    def _concat(self, parts: list[BatchedDataDict]) -> BatchedDataDict:
        return BatchedDataDict.concat(parts, pad_values={"input_ids": self.pad_token_id})

    def refit(self, policy: PolicyInterface) -> None:
        """Loads ``policy``'s current weights into every worker, in buckets."""
        from opd.distributed.fsdp_policy import FSDPPolicy

        if isinstance(policy, FSDPPolicy):  # rank 0 of the trainer fills the buckets itself
            refs = policy.weight_buckets(self.refit_bucket_bytes)
        else:
            refs = put_in_buckets(policy.weights_for_refit(), self.refit_bucket_bytes)
        self.workers.run_all("load_buckets", refs)

    def close(self) -> None:
        """Closes the engines and stops the workers (a worker that died already is skipped)."""
        # A dead worker's engine went with its process; the others still close theirs.
        with contextlib.suppress(WorkerError):
            self.workers.run_all("close")
        self.workers.kill()
