"""A training step reads the device a small, fixed number of times, whatever its micro-batches and loss chunks.

On a GPU, every read of a tensor as a Python value (``item``, ``float``, ``int``, ``bool``, ``tolist``) waits for
all queued kernels. These tests count such reads during one :meth:`HFPolicy.train` call (teacher scoring included)
by wrapping those methods of ``torch.Tensor``, for every loss type, fused and not, with the token cap and the
off-policy correction, and require:

* at most :data:`MOST_READS_PER_STEP` reads;
* the same count for 1 micro-batch as for 4, and for 1 loss chunk per micro-batch as for many (nothing read per
  micro-batch or per chunk).

On CPU a read of host data (the batch before it moves to the device) counts too, so the bound is conservative.
``scripts/gpu_check.py`` runs the GPU form with ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable, Iterator

import pytest
import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.data.sequences import pack_sequences
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.losses.hybrid_loss import FullVocabHybridLossFn
from opd.losses.off_policy import OffPolicyCorrection
from opd.losses.sampled_token import SampledTokenLossFn
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import LossFunction
from opd.models.tiny import build_tiny_model
from opd.policy.hf_policy import HFPolicy, OptimizerConfig
from opd.teachers.local_teacher import LocalTeacher

MOST_READS_PER_STEP = 6
"""Reads allowed in one optimizer step: the batch's token count, its micro-batch widths, the metrics and norm."""

KNOWN_LIBRARY_READS = tuple(f"masking_utils.py:{line}" for line in range(200, 400))
"""transformers reads the padding mask at each forward, to run SDPA causal without a mask where rows are unpadded.

Per forward, not per chunk; opd leaves it (an attention mask is needed for right-padded rows)."""

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
LENGTHS = [5, 23, 9, 9, 31, 2, 17, 12]
SAMPLER = GenerateStrategyConfig(decoding_method="top_p", temperature=1.0, top_p=0.9)


@contextlib.contextmanager
def counting_reads() -> Iterator[list[str]]:
    """Counts the reads of tensors as Python values while open; yields the list of their call sites."""
    sites: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def read(self, *args, **kwargs):
            caller = next(
                frame
                for frame in reversed(traceback.extract_stack()[:-1])
                if "/torch/" not in frame.filename and frame.filename != __file__
            )
            owner = "opd" if f"{os.sep}opd{os.sep}" in caller.filename else "library"
            sites.append(f"{name} in {owner} at {caller.filename.rsplit(os.sep, 2)[-1]}:{caller.lineno}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield sites
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def batch() -> BatchedDataDict:
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 120, (n,), generator=generator).tolist() for n in LENGTHS]
    data = pack_sequences(sequences, [max(1, n // 3) for n in LENGTHS], 0, True)
    width = data["input_ids"].shape[1]
    data["generation_logprobs"] = -0.5 - torch.rand((len(LENGTHS), width), generator=generator)
    data["task_reward"] = torch.tensor([1.0, 0.0] * 4)
    data["staleness"] = torch.tensor([1, 0, 2, 1, 0, 1, 1, 0])
    return data


LOSSES: dict[str, Callable[[int | None], LossFunction]] = {
    "full_vocab_fused": lambda chunk: KLLossFn("mixed", 0.3, fused_lm_head=True, chunk_size=chunk),
    "full_vocab_token_clip": lambda chunk: KLLossFn("forward", fused_lm_head=True, chunk_size=chunk, token_clip=3.0),
    "full_vocab_logits": lambda chunk: KLLossFn("reverse"),
    "full_vocab_off_policy": lambda chunk: KLLossFn(
        "reverse", fused_lm_head=True, chunk_size=chunk, off_policy=OffPolicyCorrection(2.0, None, (0.5, 2.0), SAMPLER)
    ),
    "jsd_fused": lambda chunk: JSDLossFn(0.5, fused_lm_head=True, chunk_size=chunk),
    "topk": lambda chunk: TopKKLLossFn("reverse", k=8, fused_lm_head=True, chunk_size=chunk),
    "sampled_token": lambda chunk: SampledTokenLossFn(
        discount=0.7, adv_tau=0.5, clip_ratio=None, fused_lm_head=True, chunk_size=chunk
    ),
    "hybrid_off_policy": lambda chunk: FullVocabHybridLossFn(
        adv_tau=0.5, off_policy=OffPolicyCorrection(2.0, (0.2, 5.0), None, SAMPLER, level="sequence")
    ),
}


def reads_in_one_step(loss_name: str, micro_batch_size: int, chunk_rows: int | None) -> list[str]:
    torch.manual_seed(0)
    policy = HFPolicy(build_tiny_model("student"), OptimizerConfig(learning_rate=1e-3), micro_batch_size, 1)
    # Prompt sharing groups rows by reading their prompts from the micro-batch on the host, before it moves to the
    # device (no sync on a GPU); on CPU that read would look like one, so this teacher runs every row.
    teacher = LocalTeacher(build_tiny_model("teacher"), share_prompt_forward=False)
    loss_fn = LOSSES[loss_name](chunk_rows)
    signal = functools.partial(teacher.score, request=loss_fn.teacher_request)
    data = batch()
    policy.train(data, loss_fn, teacher_signal=signal)  # warm: first calls may read what later ones cache
    with counting_reads() as sites:
        metrics = policy.train(data, loss_fn, teacher_signal=signal)
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["grad_norm"] > 0
    return sites


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_a_step_reads_the_device_a_fixed_small_number_of_times(loss_name):
    one_micro_batch_one_chunk = reads_in_one_step(loss_name, len(LENGTHS), None)
    four_micro_batches_many_chunks = reads_in_one_step(loss_name, 2, 3)
    own = sorted(site for site in one_micro_batch_one_chunk if " in opd " in site)
    assert len(own) <= MOST_READS_PER_STEP, "\n".join(own)
    assert sorted(site for site in four_micro_batches_many_chunks if " in opd " in site) == own, (
        "opd's reads grow with micro-batches or chunks:\n" + "\n".join(four_micro_batches_many_chunks)
    )
    unknown = [
        site
        for site in one_micro_batch_one_chunk + four_micro_batches_many_chunks
        if " in library " in site and not site.endswith(KNOWN_LIBRARY_READS)
    ]
    assert not unknown, "\n".join(unknown)


def test_the_counter_sees_each_kind_of_read():
    tensor = torch.tensor([1.5])
    with counting_reads() as sites:
        tensor.item(), float(tensor), int(tensor), bool(tensor), tensor.tolist(), [0, 1][torch.tensor(1)]
    assert [site.split()[0] for site in sites] == ["item", "__float__", "__int__", "__bool__", "tolist", "__index__"]
