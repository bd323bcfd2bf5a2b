"""GPU check of the refit transports: CUDA IPC at the 1.5B student's size, and opd's own refit path on Ray.

Needs one CUDA GPU (nothing here runs without one); about a minute on an H100.

Part 1, ``ipc``: two processes on one GPU, as a colocated trainer rank and rollout engine
are. The producer makes Qwen2.5-1.5B-shaped weights in bf16 (random, from a seed: 1.54 B
parameters, 3.1 GB, the head tied to the embedding), packs them into buckets of
``--bucket-mb`` as opd's refit does: bucket i into buffer i mod 2 of two it keeps
(:class:`opd.distributed.refit.wire.RefitBuffers`), one CUDA IPC handle per buffer, which
the consumer opens once; the consumer copies each bucket into its own weights and
acknowledges, and the producer packs bucket i+1 meanwhile, reusing a buffer only once its
bucket is acknowledged. The clock starts once the consumer reports ready (its start-up,
CUDA context and zero-filled weights are not the refit's). At the end the consumer regenerates
the weights from the seed and checks its copies bitwise. Printed: GB moved, seconds,
GB/s, and the same bytes through host memory (device → pinned host → device, what the
object store path costs at least) for comparison.

Part 2, ``opd``: the real path. A private Ray cluster with one trainer rank and one
rollout worker colocated on the GPU (``cluster.gpus_per_worker=1``, the tiny config in
bf16), so ``refit_transport: auto`` resolves to ``cuda_ipc``; one training step moves the
trainer's weights, then a refit over CUDA IPC and one over the object store each leave
in the rollout worker the trainer's weights cast to bf16, bitwise; their ``refit/bytes``
and times are printed. With two GPUs or more, a split 1+1 run checks the NCCL broadcast
the same way.

Usage (from the repository root): ``python scripts/gpu_checks/refit_ipc.py [--parts ipc opd]
[--bucket-mb 256]``. Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

SEED = 1234
# Qwen2.5-1.5B-Instruct's shapes (config.json): hidden 1536, MLP 8960, 28 layers,
# 12 query heads and 2 key/value heads of 128, vocabulary 151936, tied embeddings.
HIDDEN, MLP, LAYERS, KV, VOCAB = 1536, 8960, 28, 256, 151936


def qwen_1_5b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        shapes += [
            (prefix + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (prefix + "self_attn.q_proj.bias", (HIDDEN,)),
            (prefix + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (prefix + "self_attn.k_proj.bias", (KV,)),
            (prefix + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (prefix + "self_attn.v_proj.bias", (KV,)),
            (prefix + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (prefix + "mlp.gate_proj.weight", (MLP, HIDDEN)),
            (prefix + "mlp.up_proj.weight", (MLP, HIDDEN)),
            (prefix + "mlp.down_proj.weight", (HIDDEN, MLP)),
            (prefix + "input_layernorm.weight", (HIDDEN,)),
            (prefix + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return [*shapes, ("model.norm.weight", (HIDDEN,))]


def seeded_weight(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(SEED + index)
    return torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32).to(torch.bfloat16)


# --------------------------------------------------------------------------- part 1: two processes, one GPU


def _consumer(handles: mp.Queue, acks: mp.Queue) -> None:
    from opd.distributed.refit.wire import layout_bytes, open_ipc_handle, unpack

    torch.cuda.set_device(0)
    own = {name: torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for name, shape in qwen_1_5b_shapes()}
    torch.cuda.synchronize()
    acks.put("ready")  # the producer's clock starts only now: start-up, CUDA context and zero-fill are not the refit's
    mapped: dict[tuple, torch.Tensor] = {}  # the producer's two buffers, each opened once
    while (message := handles.get()) is not None:
        handle, layout = message
        if handle not in mapped:
            mapped[handle] = open_ipc_handle(handle, torch.device("cuda", 0))
        for name, tensor in unpack(mapped[handle][: layout_bytes(layout)], layout):
            own[name].copy_(tensor)
        torch.cuda.current_stream().synchronize()
        acks.put(True)
    mapped.clear()
    wrong = [
        name
        for index, (name, shape) in enumerate(qwen_1_5b_shapes())
        if not torch.equal(own[name], seeded_weight(index, shape))
    ]
    acks.put(wrong)


def check_ipc(bucket_bytes: int) -> dict[str, object]:
    """opd's CUDA IPC protocol between two processes: two buffers kept by the producer (one handle each, opened once
    by the consumer), bucket i+1 packed while bucket i is copied; the clock starts after the consumer is ready."""
    from opd.distributed.refit.buckets import in_buckets
    from opd.distributed.refit.wire import RefitBuffers, ipc_handle, layout_bytes, layout_of, pack

    torch.cuda.set_device(0)
    weights = [(name, seeded_weight(index, shape)) for index, (name, shape) in enumerate(qwen_1_5b_shapes())]
    total = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
    largest = max(layout_bytes(layout_of(bucket)) for bucket in in_buckets(weights, bucket_bytes))
    buffers = RefitBuffers(largest, torch.device("cuda", 0))
    buffer_handles = tuple(ipc_handle(buffer) for buffer in buffers.buffers)
    context = mp.get_context("spawn")
    handles, acks = context.Queue(), context.Queue()
    consumer = context.Process(target=_consumer, args=(handles, acks))
    consumer.start()
    if acks.get(timeout=600) != "ready":
        raise SystemExit("the IPC consumer did not start")
    torch.cuda.synchronize()
    start = time.perf_counter()
    buckets = 0
    for index, bucket in enumerate(in_buckets(weights, bucket_bytes)):
        if index >= 2:
            acks.get(timeout=120)  # bucket i - 2 is copied: its buffer may be packed again
        layout = layout_of(bucket)
        pack(bucket, buffers.view(index, layout_bytes(layout)))
        torch.cuda.current_stream().synchronize()
        handles.put((buffer_handles[index % 2], layout))
        buckets += 1
    for _ in range(min(buckets, 2)):
        acks.get(timeout=120)
    seconds = time.perf_counter() - start
    handles.put(None)
    wrong = acks.get(timeout=600)
    consumer.join(timeout=60)

    # The host round trip the object store needs at the least (pinned, both ways).
    # A bucket holds at least one tensor: the embedding alone (467 MB) outgrows a 256 MB bucket.
    staging = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    host_start = time.perf_counter()
    for bucket in in_buckets(weights, bucket_bytes):
        buffer = pack(bucket)
        host = staging[: buffer.numel()]
        host.copy_(buffer)
        buffer.copy_(host)
    torch.cuda.synchronize()
    host_seconds = time.perf_counter() - host_start
    return {
        "check": "CUDA IPC, 1.5B bf16, 2 processes",
        "ok": wrong == [] and consumer.exitcode == 0,
        "detail": f"{total / 1e9:.2f} GB in {buckets} buckets: {seconds:.3f} s, {total / seconds / 1e9:.1f} GB/s "
        f"(host round trip {host_seconds:.3f} s, {total / host_seconds / 1e9:.1f} GB/s); "
        f"{len(wrong) if isinstance(wrong, list) else wrong} tensors differ",
    }


# --------------------------------------------------------------------------- part 2: opd's refit on Ray


def check_opd(placement: str, on_gpu: bool = True) -> list[dict[str, object]]:
    from opd_test_helpers import short_run_overrides

    from opd.data.batches import build_fixed_data_batch
    from opd.distillation.config import MasterConfig
    from opd.distillation.setup import setup
    from opd.distributed.refit.transport import ObjectStoreTransport
    from opd.losses.nll import NLLLossFn
    from opd.utils.config import load_config

    config = load_config(
        MasterConfig,
        REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml",
        [
            *short_run_overrides(Path(tempfile.mkdtemp(prefix="opd_refit_gpu_")), "refit"),
            "model.dtype=bfloat16",
            "model.device=auto",
            f"cluster.gpus_per_worker={int(on_gpu)}",
            f"cluster.placement={placement}",
            # On CPU workers (--cpu) auto would pick the object store twice: take the broadcast (gloo).
            *([] if on_gpu else ["cluster.rollout.refit_transport=broadcast"]),
            "cluster.trainer.workers=1",
            "cluster.rollout.workers=1",
            "training.warmup_steps=0",
            "training.batch_size=4",
        ],
    )
    parts = setup(config)
    rows = []
    try:
        generation = parts.student_generation
        policy = parts.student_policy
        examples = next(iter(parts.dataloader))
        expected_transport = {"colocated": "cuda_ipc", "split": "broadcast"}[placement] if on_gpu else "broadcast"
        if generation.transport.name != expected_transport:
            raise SystemExit(
                f"{placement}: refit_transport auto gave {generation.transport.name}, not {expected_transport}"
            )
        transports = [generation.transport]
        transports.append(ObjectStoreTransport(generation.workers, generation.refit_bucket_bytes, torch.bfloat16, 60))
        for transport in transports:
            policy.train(build_fixed_data_batch(examples, parts.tokenizer.pad_token_id, True), NLLLossFn())
            expected = {name: tensor.to(torch.bfloat16).cpu() for name, tensor in policy.weights_for_refit()}
            start = time.perf_counter()
            report = transport.send(policy.workers)
            seconds = time.perf_counter() - start
            held = generation.workers.run_all("weights")[0]
            wrong = [name for name, tensor in expected.items() if not torch.equal(held[name], tensor)]
            rows.append(
                {
                    "check": f"opd refit, {placement} 1+1, {transport.name}",
                    "ok": not wrong and report.gathered_bytes == sum(t.numel() * 2 for t in expected.values()),
                    "detail": f"refit/bytes {report.gathered_bytes}, delivered {report.delivered_bytes}, "
                    f"{seconds * 1000:.1f} ms (first refit: includes any group set-up); {len(wrong)} tensors differ",
                }
            )
    finally:
        parts.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["ipc", "opd"], default=["ipc", "opd"])
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument(
        "--cpu", action="store_true", help="check this script without a GPU: part 2 on CPU workers (gloo broadcast)"
    )
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    if args.cpu:
        rows = check_opd("colocated", on_gpu=False)
    elif not torch.cuda.is_available():
        raise SystemExit("refit_ipc.py needs a CUDA GPU (--cpu checks the script itself)")
    else:
        if "ipc" in args.parts:
            rows.append(check_ipc(int(args.bucket_mb * 1024 * 1024)))
        if "opd" in args.parts:
            rows += opd_rows()
        print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'check':<44}{'result':<8}detail")
    for row in rows:
        result = "skipped" if row["ok"] is None else ("pass" if row["ok"] else "FAIL")
        print(f"{row['check']:<44}{result:<8}{row['detail']}")
    ok = all(row["ok"] is not False for row in rows)
    # The last line, for scripts/gpu_check.py's table.
    print(json.dumps({"ok": ok, "figure": "; ".join(f"{row['check']}: {row['detail']}" for row in rows)}))
    sys.exit(0 if ok else 1)


def opd_rows() -> list[dict[str, object]]:
    """Part 2 on the GPU: colocated (CUDA IPC) always, split (NCCL broadcast) with two GPUs; Ray is needed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return [{"check": "opd refit on Ray", "ok": None, "detail": "Ray is not installed here"}]
    rows = check_opd("colocated")
    if torch.cuda.device_count() >= 2:
        return rows + check_opd("split")
    return [*rows, {"check": "opd refit, split 1+1, broadcast (NCCL)", "ok": None, "detail": "needs 2 GPUs"}]


if __name__ == "__main__":
    main()
