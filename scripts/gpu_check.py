"""Everything about the GPU path that a CPU cannot check, on one GPU, in one table.

Run by ``scripts/gpu_check.sh`` (which installs what the machine lacks first). Each check
runs in a child process of its own, so that one that crashes or exhausts the GPU cannot
take the others with it, and every row of the table says ``ok``, ``FAILED`` (with the
error's last line), ``missing`` (a check whose script is not in the checkout or whose
packages are not installed: what is missing) or ``skipped`` (a check that does not apply
to this machine: why). Figures are this machine's, measured now. The exit status is 1
when any check failed or is missing: a check that cannot run has checked nothing, and
must not pass for one that did.

Checks:

* ``nccl_trainer``: opd's own trainer rank (``TrainerWorker.start``) joins an NCCL process
  group, loads the demo student and a sharded colocated teacher, and takes two optimizer
  steps of the exact fused full-vocabulary loss in bf16 (the global metrics are summed
  over the ranks by an NCCL all-reduce);
* ``bf16_fused_loss``: the chunked fused loss in bf16 against a float64 reference at the
  real vocabulary (151,936 columns);
* ``offload``: optimizer state and teacher to host and back: GPU memory before and after;
* ``sharded_loading``: a Qwen2.5-0.5B-shaped student (random weights, bf16 file) loaded
  straight into its shard: peak GPU memory against the fp32 master weights' size;
* ``qwen05b_step``: one training step of that student at the real vocabulary: step time,
  TFLOP/s and MFU (student 6·N·T plus teacher 2·N·T), host syncs per step
  (``torch.cuda.set_sync_debug_mode``), and peak memory allocated and reserved, beside
  ``opd plan``'s prediction for the same shapes; then the same step without the per-step
  diagnostics (``loss_fn.diagnostics_every: 0``), whose time and MFU show their share;
* ``qwen15b_step``: the same at the specification's student shape (Qwen2.5-1.5B);
* ``qwen15b_checkpointed``: the same with the student's activation checkpointing;
* ``pooled_hidden_states``: the exact loss with the teacher apart (a teacher-pool worker
  sends its final hidden states to the host, the trainer rank binds them to the output
  layer it loaded alone) against the same rank with the teacher colocated, in bf16;
* ``lora_nccl``: a LoRA student on the NCCL trainer rank: two steps, only adapters train;
* ``multi_turn``: two steps of the driver with the calculator environment on the GPU
  (the first turn of each episode is a scripted tool call, as in the CPU test);
* ``demo_20_steps``: 20 steps of the CPU demo's distillation on the GPU (bf16);
* ``vllm``: ``scripts/gpu_checks/vllm_refit.py`` (needs vLLM and Ray): the rollout path on
  Ray, a vLLM rollout worker colocated with a trainer rank, refit in several buckets over
  ``cuda_ipc`` and ``object_store``; its greedy rollouts equal an HF student's with the
  trainer's weights token for token, and its engine sleeps between rollouts (GPU memory
  freed, refit seconds, bytes, buckets);
* ``refit_ipc``: ``scripts/gpu_checks/refit_ipc.py``: CUDA IPC between two processes at the
  1.5B student's size (bitwise, GB/s), and opd's ``cuda_ipc`` and ``object_store`` refits
  on a Ray cluster colocated on the GPU (bitwise, ``refit/bytes``); without Ray the
  second part cannot run, and the row says ``missing``.

In a rehearsal (``--rehearse``) the two scripts run with ``--cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# --rehearse runs every check on the CPU (gloo, float32 where bf16 would be slow, small
# shapes), to find a broken check before a GPU's time is spent on it.
REHEARSAL = os.environ.get("OPD_GPU_CHECK_REHEARSAL") == "1"
DEVICE = "cpu" if REHEARSAL else "cuda"


class _Memory:
    """``torch.cuda``'s memory counters, or zeros in a rehearsal on the CPU."""

    def __getattr__(self, name: str) -> Any:
        import torch

        if REHEARSAL:
            return lambda *args, **kwargs: 0 if name != "synchronize" else None
        return getattr(torch.cuda, name)


cuda = _Memory()


def _cuda() -> Any:
    import torch

    if not REHEARSAL and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script checks the GPU path")
    return torch


def _demo_config(overrides: list[str]) -> Any:
    from opd.distillation.config import MasterConfig
    from opd.utils.config import load_config

    return load_config(MasterConfig, REPO_ROOT / "examples" / "configs" / "demo.yaml", overrides)


def _demo_batch(tokenizer: Any, rows: int, length: int, seed: int = 0) -> Any:
    import torch

    from opd.data.sequences import pack_sequences

    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(3, len(tokenizer) - 1, (length,), generator=generator).tolist() for _ in range(rows)]
    return pack_sequences(sequences, [length // 4] * rows, tokenizer.pad_token_id, True)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def in_place(loss_fn: Any, micro_batches: int) -> list[Any]:
    """What the driver's colocated teacher answers for each micro-batch: score it in the worker."""
    from opd.models.interfaces import AnsweredWhereTrained

    return [AnsweredWhereTrained(loss_fn.teacher_request)] * micro_batches


def _trainer(student: str, teacher: str | None, total_steps: int = 2, **spec_fields: Any) -> Any:
    """A one-rank trainer over NCCL, started the way a Ray actor starts it (``spec_fields``: more of its spec)."""
    from opd.distributed.trainer_worker import TrainerSpec, TrainerWorker
    from opd.models.config import ModelLoadingConfig, OptimizerConfig

    spec = TrainerSpec(
        student_path=student,
        teacher_path=teacher,
        loading=ModelLoadingConfig(dtype="float32" if REHEARSAL else "bfloat16", device=DEVICE),
        optimizer=OptimizerConfig(),
        total_steps=total_steps,
        backend="gloo" if REHEARSAL else "nccl",
        timeout_s=120,
        threads=4,
        **spec_fields,
    )
    worker = TrainerWorker(0, 1, spec)
    worker.start("127.0.0.1", _free_port())
    return worker


def check_nccl_trainer() -> dict[str, Any]:
    _cuda()
    from opd.distillation.setup import build_loss
    from opd.models.loading import load_tokenizer

    config = _demo_config([f"model.device={DEVICE}", "model.dtype=bfloat16"])
    tokenizer = load_tokenizer(config.model.student_model_path)
    loss_fn = build_loss(config, tokenizer)
    worker = _trainer(config.model.student_model_path, config.model.teacher_model_path)
    batch = _demo_batch(tokenizer, rows=8, length=96)
    tokens = int(batch["token_mask"][:, 1:].sum())
    losses, seconds = [], []
    for _ in range(2):
        start = time.perf_counter()
        metrics = worker.train(
            loss_fn, tokens, batch.size, [batch.select_indices(list(range(batch.size)))], in_place(loss_fn, 1)
        )
        cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    worker.shutdown()
    finite = all(value == value and abs(value) != float("inf") for value in losses)
    return {
        "ok": finite and losses[1] < losses[0],
        "figure": f"losses {losses[0]:.4f} -> {losses[1]:.4f}, step {seconds[1] * 1000:.0f} ms "
        f"(first {seconds[0] * 1000:.0f} ms)",
    }


def check_bf16_fused_loss() -> dict[str, Any]:
    torch = _cuda()
    from opd.kernels.fused_lm_head import chunked_lm_head_loss
    from opd.losses.divergences import token_kl
    from opd.models.lm_head import LMHeadInput

    vocab, hidden_size, positions = (151_936, 1536, 2048) if not REHEARSAL else (4096, 64, 512)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(positions, hidden_size, device=DEVICE, generator=generator) * 0.5
    weight = torch.randn(vocab, hidden_size, device=DEVICE, generator=generator) * 0.02
    teacher_hidden = torch.randn(positions, hidden_size, device=DEVICE, generator=generator) * 0.5
    teacher_weight = torch.randn(vocab, hidden_size, device=DEVICE, generator=generator) * 0.02
    weights = torch.full((positions,), 1.0 / positions, device=DEVICE)
    reference = 0.0
    for first in range(0, positions, 256):  # float64, in chunks (a [2048 × 151936] float64 is 2.5 GB)
        rows = slice(first, first + 256)
        student_logits = hidden[rows].double() @ weight.double().T
        teacher_logits = teacher_hidden[rows].double() @ teacher_weight.double().T
        reference += float((token_kl(student_logits, teacher_logits, "forward") * weights[rows].double()).sum())
    cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    student = LMHeadInput(hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_(), None)
    teacher = LMHeadInput(teacher_hidden.bfloat16(), teacher_weight.bfloat16(), None)
    loss = chunked_lm_head_loss(
        student,
        lambda logits, teacher_logits: token_kl(logits.float(), teacher_logits.float(), "forward"),
        (teacher,),
        weights,
    )
    loss.backward()
    cuda.synchronize()
    seconds = time.perf_counter() - start
    error = abs(float(loss) - reference) / abs(reference)
    return {
        "ok": error < 2e-2,
        "figure": f"bf16 {float(loss):.6f} vs float64 {reference:.6f}: relative error {error:.2e}; "
        f"forward+backward {seconds * 1000:.0f} ms, peak {cuda.max_memory_allocated() / GIB:.2f} GiB",
    }


def check_offload() -> dict[str, Any]:
    _cuda()
    from opd.distillation.setup import build_loss
    from opd.models.loading import load_tokenizer

    config = _demo_config([f"model.device={DEVICE}", "model.dtype=bfloat16"])
    tokenizer = load_tokenizer(config.model.student_model_path)
    worker = _trainer(config.model.student_model_path, config.model.teacher_model_path)
    batch = _demo_batch(tokenizer, rows=4, length=64)
    loss_fn = build_loss(config, tokenizer)
    worker.train(loss_fn, int(batch["token_mask"][:, 1:].sum()), batch.size, [batch], in_place(loss_fn, 1))
    cuda.synchronize()
    before = cuda.memory_allocated()
    moved = worker.offload_to_host()
    during = cuda.memory_allocated()
    devices = worker.state_devices()
    back = worker.reload_to_device()
    after = cuda.memory_allocated()
    worker.shutdown()
    ok = devices["optimizer"] == ["cpu"] and back == moved
    if not REHEARSAL:  # on the CPU nothing moves
        ok = ok and moved > 0 and during < before and after >= before - 2**20  # allocator rounding
    return {
        "ok": ok,
        "figure": f"moved {moved / 2**20:.1f} MiB; allocated {before / 2**20:.1f} -> {during / 2**20:.1f} -> "
        f"{after / 2**20:.1f} MiB; state on {devices}",
    }


def _qwen_directory(shape: str = "Qwen2.5-0.5B-Instruct") -> str:
    """A model of one of Qwen2.5's shapes (opd's shipped ``config.json``) with random weights, saved in bf16.

    Built once per machine; two layers in a rehearsal.
    """
    torch = _cuda()
    from transformers import AutoConfig, AutoModelForCausalLM

    from opd.models.tiny import build_tiny_tokenizer

    directory = Path(tempfile.gettempdir()) / (f"opd_gpu_check_{shape}" + ("_rehearsal" if REHEARSAL else ""))
    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return str(directory)
    fields = json.loads((REPO_ROOT / "opd" / "models" / "shapes" / shape / "config.json").read_text())
    if REHEARSAL:
        fields["num_hidden_layers"] = 2  # before the config is built: its per-layer settings follow it
    config = AutoConfig.for_model(**fields)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def check_sharded_loading() -> dict[str, Any]:
    _cuda()
    directory = _qwen_directory()
    cuda.reset_peak_memory_stats()
    cuda.empty_cache()
    base = cuda.memory_allocated()
    worker = _trainer(directory, None)
    peak = cuda.max_memory_allocated() - base
    masters = sum(p.numel() for p in worker.model.parameters()) * 4
    worker.shutdown()
    return {
        # The bound of the CPU test (tests/distributed/test_sharded_loading.py): one copy, plus
        # transients (a tied embedding is allocated under both its names while to_empty runs).
        "ok": peak <= 1.6 * masters,
        "figure": f"peak {peak / GIB:.2f} GiB for {masters / GIB:.2f} GiB of fp32 master weights "
        f"({peak / masters:.2f} x)",
    }


# A Qwen2.5 step: the spec's cluster config at one rank, one shape as student and as
# colocated teacher, one micro-batch of 4 rows of 256 prompt + 1,792 response tokens.
STEP_ROWS, STEP_PROMPT, STEP_RESPONSE = 4, 256, 1792
SPEC_CLUSTER_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_math_cluster.yaml"


def _step_overrides(shape: str) -> list[str]:
    return [
        f"model.student_model_path=Qwen/{shape}",
        f"model.teacher_model_path=Qwen/{shape}",
        "cluster.trainer.workers=1",
        "cluster.rollout.workers=1",
        f"training.batch_size={STEP_ROWS}",
        f"training.micro_batch_size={STEP_ROWS}",
        "distillation.num_samples_per_prompt=1",
        f"data.max_prompt_length={STEP_PROMPT}",
        f"distillation.generate_strategy.max_length={STEP_RESPONSE}",
    ]


class _VocabularyOnly:
    """What the loss asks of a tokenizer (its length): Qwen2.5's 151,669 tokens, with no tokenizer files."""

    def __len__(self) -> int:
        from opd.models.model_shapes import SHIPPED_TOKENIZER_SIZE

        return SHIPPED_TOKENIZER_SIZE


BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peak by device name (the vendors' figures, without sparsity)."""


def _peak_flops(torch: Any) -> float | None:
    name = torch.cuda.get_device_name() if not REHEARSAL else ""
    # The longest match first: "H200" must not be read as "H20".
    matches = [key for key in BF16_PEAK_FLOPS if key in name]
    return BF16_PEAK_FLOPS[max(matches, key=len)] if matches else None


def _host_syncs(torch: Any, run: Callable[[], Any]) -> int:
    """How often ``run`` made the host wait for the GPU (``torch.cuda.set_sync_debug_mode``'s warnings)."""
    import warnings

    if REHEARSAL:
        run()
        return 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def _qwen_step(shape: str, checkpointing: bool = False) -> dict[str, Any]:
    """Four steps of ``shape`` as student and colocated teacher: the steady step's time, MFU, host syncs and peak
    (allocated and reserved), and the plan's peak.

    ``checkpointing``: the student recomputes each layer's activations in the backward pass. MFU counts the
    student's 6·N·T and the teacher's 2·N·T over every token of the micro-batch (N: parameters, a tied head once).
    """
    torch = _cuda()
    from opd.data.sequences import pack_sequences
    from opd.distillation.config import MasterConfig
    from opd.distillation.setup import build_loss
    from opd.utils.config import load_config

    directory = _qwen_directory(shape)
    rows, prompt, length = (STEP_ROWS, STEP_PROMPT, STEP_PROMPT + STEP_RESPONSE) if not REHEARSAL else (1, 16, 64)
    overrides = _step_overrides(shape)
    config = load_config(MasterConfig, SPEC_CLUSTER_CONFIG, overrides)
    loss_fn = build_loss(config, _VocabularyOnly())
    worker = _trainer(directory, directory, activation_checkpointing=checkpointing)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 151_000, (length,), generator=generator).tolist() for _ in range(rows)]
    batch = pack_sequences(sequences, [prompt] * rows, 0, True)
    tokens = int(batch["token_mask"][:, 1:].sum())

    def step(loss: Any) -> None:
        worker.train(loss, tokens, rows, [batch], in_place(loss, 1))

    def timed_step(loss: Any) -> float:
        start = time.perf_counter()
        step(loss)
        cuda.synchronize()
        return time.perf_counter() - start

    seconds = [timed_step(loss_fn)]
    cuda.reset_peak_memory_stats()  # steady state: Adam's moments exist from the first step on
    seconds += [timed_step(loss_fn) for _ in range(2)]
    peak, reserved = cuda.max_memory_allocated(), cuda.max_memory_reserved()
    syncs = _host_syncs(torch, lambda: step(loss_fn))
    # The same step without the per-step diagnostics (two top-k and both log-normalisers in every loss chunk):
    # their share of the step, measured beside it, says whether diagnostics_every's default should change.
    quiet_loss = build_loss(
        load_config(MasterConfig, SPEC_CLUSTER_CONFIG, [*overrides, "loss_fn.diagnostics_every=0"]), _VocabularyOnly()
    )
    quiet_seconds = [timed_step(quiet_loss) for _ in range(2)]
    parameters = sum(p.numel() for p in worker.model.parameters())  # the same shape is the teacher
    worker.shutdown()
    step_s, quiet_s = min(seconds[1:]), min(quiet_seconds)
    flops = (6 + 2) * parameters * rows * length
    peak_flops = _peak_flops(torch)

    def mfu(seconds: float) -> str:
        return f", MFU {flops / seconds / peak_flops:.1%}" if peak_flops else ""

    figure = (
        f"{rows} x {length} tokens, fused {config.loss_fn.type} loss, the same shape as colocated teacher"
        f"{', activation checkpointing' if checkpointing else ''}: "
        f"step {step_s * 1000:.0f} ms, {flops / step_s / 1e12:.0f} TFLOP/s{mfu(step_s)}, {syncs} host syncs per step, "
        f"peak {peak / GIB:.2f} GiB allocated, {reserved / GIB:.2f} GiB reserved; "
        f"without the per-step diagnostics {quiet_s * 1000:.0f} ms{mfu(quiet_s)}"
    )
    ok = True
    if not REHEARSAL:
        predicted = _dry_run_prediction(shape, checkpointing)
        error = (predicted - peak) / peak
        figure += (
            f"; opd plan predicts {predicted / GIB:.2f} GiB ({error:+.1%} of the allocated peak, "
            f"{(predicted - reserved) / reserved:+.1%} of the reserved)"
        )
        ok = abs(error) <= 0.15
    return {"ok": ok, "figure": figure}


def check_qwen05b_step() -> dict[str, Any]:
    return _qwen_step("Qwen2.5-0.5B-Instruct")


def check_qwen15b_step() -> dict[str, Any]:
    return _qwen_step("Qwen2.5-1.5B-Instruct")


def check_qwen15b_checkpointed() -> dict[str, Any]:
    return _qwen_step("Qwen2.5-1.5B-Instruct", checkpointing=True)


def _dry_run_prediction(shape: str, checkpointing: bool) -> float:
    """``opd plan``'s peak for the step of :func:`_qwen_step` (one plan per shape and machine, kept in a file)."""
    saved = Path(tempfile.gettempdir()) / f"opd_gpu_check_plan_{shape}.json"
    if saved.exists():
        plan = json.loads(saved.read_text())
        return float(max(rank["peak"] for rank in plan["ranks"]["on" if checkpointing else "off"]))
    command = [
        sys.executable,
        "-m",
        "opd",
        "plan",
        "--config",
        str(SPEC_CLUSTER_CONFIG),
        *_step_overrides(shape),
        "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"opd plan failed: {(result.stderr.strip().splitlines() or ['no output'])[-1]}")
    saved.write_text(result.stdout)
    return _dry_run_prediction(shape, checkpointing)


def check_pooled_hidden_states() -> dict[str, Any]:
    _cuda()
    from opd.distillation.setup import build_loss
    from opd.models.config import ModelLoadingConfig
    from opd.models.interfaces import TeacherHiddenStates
    from opd.models.loading import load_causal_lm, load_tokenizer, resolve_dtype
    from opd.teachers.local_teacher import LocalTeacher

    config = _demo_config([f"model.device={DEVICE}", "model.dtype=bfloat16"])
    student, teacher = config.model.student_model_path, config.model.teacher_model_path
    tokenizer = load_tokenizer(student)
    loss_fn = build_loss(config, tokenizer)
    batch = _demo_batch(tokenizer, rows=8, length=96)
    tokens = int(batch["token_mask"][:, 1:].sum())
    dtype = "float32" if REHEARSAL else "bfloat16"

    def two_steps(worker: Any, signals: Any) -> list[float]:
        losses = [worker.train(loss_fn, tokens, batch.size, [batch], signals)["loss"] for _ in range(2)]
        worker.shutdown()
        return losses

    colocated = two_steps(_trainer(student, teacher), in_place(loss_fn, 1))
    # The teacher apart, answering as a pool's worker does (``TeacherWorker.score``, whose
    # module needs Ray): its final hidden states alone, on the host.
    import torch

    loading = ModelLoadingConfig(dtype=dtype, device=DEVICE)
    device = torch.device(DEVICE)
    pool_teacher = LocalTeacher(load_causal_lm(teacher, resolve_dtype(dtype, device), device, loading))
    signal = TeacherHiddenStates(pool_teacher.get_hidden_states(batch).hidden_states.cpu())
    del pool_teacher
    apart = two_steps(_trainer(student, None, teacher_head_path=teacher), [signal])
    error = max(abs(a - b) / abs(b) for a, b in zip(apart, colocated))
    return {
        "ok": error < 1e-2 and apart[1] < apart[0],
        "figure": f"teacher apart {apart[0]:.5f} -> {apart[1]:.5f}, colocated {colocated[0]:.5f} -> "
        f"{colocated[1]:.5f}: largest relative difference {error:.1e} ({signal.hidden_states.dtype} hidden states, "
        f"{signal.hidden_states.numel() * signal.hidden_states.element_size() / 2**10:.0f} KiB on the host)",
    }


def check_lora_nccl() -> dict[str, Any]:
    _cuda()
    from opd.distillation.setup import build_loss
    from opd.models.config import LoraConfig
    from opd.models.loading import load_tokenizer

    config = _demo_config([f"model.device={DEVICE}", "model.dtype=bfloat16"])
    tokenizer = load_tokenizer(config.model.student_model_path)
    loss_fn = build_loss(config, tokenizer)
    worker = _trainer(config.model.student_model_path, config.model.teacher_model_path, lora=LoraConfig(r=8))
    trainable = {name: p.detach().float().clone() for name, p in worker.model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach().float().clone() for name, p in worker.model.named_parameters() if not p.requires_grad}
    batch = _demo_batch(tokenizer, rows=8, length=96)
    tokens = int(batch["token_mask"][:, 1:].sum())
    losses = [worker.train(loss_fn, tokens, batch.size, [batch], in_place(loss_fn, 1))["loss"] for _ in range(2)]
    after = dict(worker.model.named_parameters())
    adapters_moved = sum(not after[name].detach().float().equal(value) for name, value in trainable.items())
    base_moved = sum(not after[name].detach().float().equal(value) for name, value in frozen.items())
    worker.shutdown()
    only_adapters = all("lora_" in name for name in trainable)
    return {
        "ok": losses[1] < losses[0] and only_adapters and adapters_moved > 0 and base_moved == 0,
        "figure": f"loss {losses[0]:.4f} -> {losses[1]:.4f}; {len(trainable)} adapter tensors trainable "
        f"({adapters_moved} changed), {len(frozen)} frozen ({base_moved} changed)",
    }


def check_multi_turn() -> dict[str, Any]:
    _cuda()
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from opd_test_helpers import first_turn_calls_the_tool, short_run_overrides

    from opd.distillation.config import MasterConfig
    from opd.distillation.setup import setup
    from opd.distillation.step import distillation_train
    from opd.run.plotting import read_metrics
    from opd.utils.config import load_config

    output = Path(tempfile.mkdtemp(prefix="opd_gpu_multi_turn_"))
    overrides = [
        *short_run_overrides(output),
        f"model.device={DEVICE}",
        f"model.dtype={'float32' if REHEARSAL else 'bfloat16'}",
        "checkpointing.enabled=false",
        "training.batch_size=4",
        "training.micro_batch_size=null",
        "training.max_num_steps=2",
        "distillation.num_samples_per_prompt=2",
        "distillation.generate_strategy.max_length=8",
        "environment.max_turns=2",
        "data.max_train_examples=8",
        "data.max_prompt_length=1024",
    ]
    config = load_config(MasterConfig, REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml", overrides)
    parts = setup(config)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    first_turn_calls_the_tool(parts.student_generation, parts.tokenizer, call)
    start = time.perf_counter()
    distillation_train(parts)
    seconds = time.perf_counter() - start
    train = [record for record in read_metrics(Path(config.logger.log_dir)) if "train/on_policy" in record]
    losses = [record["train/loss"] for record in train]
    turns = [record["env/turns"] for record in train]
    calls = [record["env/tool_calls"] for record in train]
    environment = sum(record.get("timing/environment", 0.0) for record in train)
    return {
        "ok": len(train) == 2 and turns == [2.0, 2.0] and calls == [1.0, 1.0] and all(x == x for x in losses),
        "figure": f"2 steps in {seconds:.1f} s, turns {turns}, tool calls {calls}, loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f}, environment {environment * 1000:.0f} ms in all",
    }


def check_demo_20_steps() -> dict[str, Any]:
    _cuda()
    if not (REPO_ROOT / "examples" / "data" / "arithmetic" / "train.jsonl").exists():  # as run_demo.py writes it
        subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "data" / "make_arithmetic_task.py")], check=True)
    output = Path(tempfile.mkdtemp(prefix="opd_gpu_demo_"))
    command = [
        sys.executable,
        "-m",
        "opd",
        "train",
        "--config",
        str(REPO_ROOT / "examples" / "configs" / "demo.yaml"),
        f"model.device={DEVICE}",
        "model.dtype=bfloat16",
        f"training.max_num_steps={3 if REHEARSAL else 20}",
        f"output_dir={output}",
        "validation.val_at_start=false",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=400)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError((result.stderr.strip().splitlines() or ["no output"])[-1])
    from opd.run.plotting import read_metrics

    records = [record for record in read_metrics(output / "logs") if "train/loss" in record]
    steps = 3 if REHEARSAL else 20
    accuracy = [record["val/accuracy"] for record in read_metrics(output / "logs") if "val/accuracy" in record]
    return {
        "ok": [record["step"] for record in records] == list(range(1, steps + 1)),
        "figure": f"{steps} steps in {seconds:.0f} s (start-up included); loss {records[0]['train/loss']:.3f} -> "
        f"{records[-1]['train/loss']:.3f}; final val/accuracy {accuracy[-1] if accuracy else 'n/a'}",
    }


def _missing(script: Path | None = None, packages: tuple[str, ...] = ()) -> str | None:
    """What a check needs and this machine lacks (its script in the checkout, its packages), or None."""
    import importlib.util

    missing = []
    if script is not None and not script.exists():
        missing.append(f"{script.relative_to(REPO_ROOT)} is not in this checkout")
    absent = [name for name in packages if importlib.util.find_spec(name) is None]
    if absent:
        missing.append(f"not installed: {', '.join(absent)}")
    return "; ".join(missing) or None


def _run_script(script: Path) -> dict[str, Any]:
    """Runs a check script of ``scripts/gpu_checks`` (``--cpu`` in a rehearsal); its last stdout line is the row."""
    command = [sys.executable, str(script), *(["--cpu"] if REHEARSAL else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    lines = result.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError((result.stderr.strip().splitlines() or ["no output"])[-1])
    row = json.loads(lines[-1])
    if result.returncode != 0 and row.get("ok"):  # a script that crashed after its row cannot pass
        return {"ok": False, "figure": f"exit status {result.returncode} after: {row.get('figure')}"}
    return row


def check_vllm() -> dict[str, Any]:
    script = REPO_ROOT / "scripts" / "gpu_checks" / "vllm_refit.py"
    missing = _missing(script, ("vllm", "ray"))
    if missing:
        return {"missing": missing}
    return _run_script(script)


def check_refit_ipc() -> dict[str, Any]:
    script = REPO_ROOT / "scripts" / "gpu_checks" / "refit_ipc.py"
    missing = _missing(script)
    if missing:
        return {"missing": missing}
    absent_ray = _missing(packages=("ray",))
    if absent_ray and REHEARSAL:  # --cpu runs the part on Ray alone
        return {"missing": f"{absent_ray} (refit_ipc.py --cpu runs opd's refits on Ray only)"}
    row = _run_script(script)
    # Without Ray the script runs its first part alone and calls the second skipped: here that is missing.
    if absent_ray and row.get("ok"):
        return {"missing": f"{absent_ray} (opd's refits on Ray did not run); {row.get('figure')}"}
    return row


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "nccl_trainer": check_nccl_trainer,
    "bf16_fused_loss": check_bf16_fused_loss,
    "offload": check_offload,
    "sharded_loading": check_sharded_loading,
    "qwen05b_step": check_qwen05b_step,
    "qwen15b_step": check_qwen15b_step,
    "qwen15b_checkpointed": check_qwen15b_checkpointed,
    "pooled_hidden_states": check_pooled_hidden_states,
    "lora_nccl": check_lora_nccl,
    "multi_turn": check_multi_turn,
    "demo_20_steps": check_demo_20_steps,
    "vllm": check_vllm,
    "refit_ipc": check_refit_ipc,
}


def run_one(name: str) -> None:
    """Runs one check in this process and prints its result as the last line (JSON)."""
    try:
        result = CHECKS[name]()
    except Exception as error:  # the table reports it; the other checks go on
        traceback.print_exc()
        result = {"ok": False, "figure": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    print(json.dumps(result))


def _status(result: dict[str, Any]) -> str:
    """A row's status: ``missing`` and ``skipped`` (see the module docstring), else ``ok`` or ``FAILED``."""
    if "missing" in result:
        return "missing"
    if "skipped" in result:
        return "skipped"
    return "ok" if result.get("ok") else "FAILED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=list(CHECKS), help="run one check in this process")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="the checks to run (default: all)")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds each check may take")
    parser.add_argument("--rehearse", action="store_true", help="run the checks on the CPU, small, to test them")
    arguments = parser.parse_args()
    if arguments.rehearse:
        os.environ["OPD_GPU_CHECK_REHEARSAL"] = "1"  # the children read it
    if arguments.check:
        run_one(arguments.check)
        return 0
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device (rehearsal on the CPU)"
    print(f"# opd GPU check: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    rows, failed = [], 0
    for name in arguments.only or list(CHECKS):
        start = time.perf_counter()
        try:
            child = subprocess.run(
                [sys.executable, __file__, "--check", name],
                capture_output=True,
                text=True,
                timeout=arguments.timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            lines = child.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if lines else {"ok": False, "figure": child.stderr.strip()[-300:]}
            if not result.get("ok", True) and "skipped" not in result and "missing" not in result:
                sys.stderr.write(f"--- {name} ---\n{child.stderr[-4000:]}\n")
        except subprocess.TimeoutExpired:
            result = {"ok": False, "figure": f"did not finish within {arguments.timeout:.0f} s"}
        status = _status(result)
        # A missing check counts as a failure: it checked nothing, and CI must see that.
        failed += status in ("FAILED", "missing")
        figure = result.get("missing") or result.get("skipped") or result.get("figure", "")
        rows.append((name, status, f"{time.perf_counter() - start:.0f}", figure))
        print(f"# {name}: {status} in {rows[-1][2]} s: {rows[-1][3]}", flush=True)  # kept if a later check hangs
    width = max(len("check"), *(len(row[0]) for row in rows))
    print(f"| {'check':<{width}} | status  | s    | figure |")
    print(f"|{'-' * (width + 2)}|---------|------|--------|")
    for name, status, seconds, figure in rows:
        print(f"| {name:<{width}} | {status:<7} | {seconds:>4} | {figure} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
