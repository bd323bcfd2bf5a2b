"""The remote-teacher client against a real vLLM OpenAI-compatible server on 127.0.0.1.

vLLM's ``python -m vllm.entrypoints.openai.api_server`` serves the CPU demo's teacher
(fp32); the client's top-k and token log-probs must equal the in-process teacher's within
1e-4, and the loss built from them must equal the in-process loss. Asked for answers over
``/v1/completions`` (what the validation baselines do), it answers greedy with the
in-process teacher's tokens. The server starts once for the module (about 30-40 s on the
2-core machine).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; run: bash scripts/test_vllm.sh")

import httpx
import torch
from opd_test_helpers import REPO_ROOT, BackgroundProcess, served_and_in_process_losses
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd.cli import main as opd_main
from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.stop_tokens import stop_token_ids
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.served.remote_generation import RemoteGeneration
from opd.teachers.served.remote_teacher import RemoteTeacher

TEACHER_DIR = REPO_ROOT / "examples" / "demo" / "models" / "teacher"
STUDENT_DIR = REPO_ROOT / "examples" / "demo" / "models" / "student"
K = 16
TEXTS = ["What is 123 + 456?", "5 + 5", "Add 40 and 302, then show the carry step by step."]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TEACHER_DIR),
        "--served-model-name", "demo-teacher", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--max-logprobs", str(K),
        "--kv-cache-memory-bytes", str(128 * 2**20),
    ]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    process = BackgroundProcess("vllm-server", command, tmp_path_factory.mktemp("vllm"), env, timeout=240,
                                own_process_group=True)
    try:
        process.wait_until(lambda: server_is_up(url), "the server answering /v1/models")
        yield url
    finally:
        process.stop_if_running()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TEACHER_DIR)


@pytest.fixture(scope="module")
def teacher_model():
    return AutoModelForCausalLM.from_pretrained(TEACHER_DIR, dtype=torch.float32).eval()


def batch_of(tokenizer, texts: list[str]) -> BatchedDataDict:
    """Right-padded chat rows of different lengths, with a token mask over each response."""
    ids = []
    for text in texts:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        ids.append(prompt + tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    for row, sequence in enumerate(ids):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
    lengths = torch.tensor([len(sequence) for sequence in ids])
    mask = torch.zeros_like(input_ids, dtype=torch.float32)
    for row, n in enumerate(lengths.tolist()):
        mask[row, 5:n] = 1.0
    return BatchedDataDict(input_ids=input_ids, input_lengths=lengths, token_mask=mask)


def test_the_vllm_teacher_answers_the_validation_prompts_as_in_process(vllm_server, teacher_model, tokenizer):
    # The demo's prompt, on which the teacher ends its answers with EOS.
    template = (REPO_ROOT / "examples" / "prompts" / "math_think_answer.txt").read_text().replace("{{}}", "{}")
    prompts = []
    for problem in ("What is 585 + 445?", "What is 961 + 917?", "What is 12 + 30?"):
        message = {"role": "user", "content": template.replace("{prompt}", problem)}
        prompt = tokenizer.apply_chat_template([message], add_generation_prompt=True)
        prompts.append(list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt))
    strategy = GenerateStrategyConfig(max_length=96, decoding_method="greedy")
    engine = RemoteGeneration(vllm_server, None, None, stop_token_ids(tokenizer), tokenizer.pad_token_id)
    try:
        served = engine.generate(prompts, strategy, return_logprobs=False)
    finally:
        engine.close()
    local = HFGeneration(teacher_model, tokenizer).generate(prompts, strategy, return_logprobs=False)
    for key in ("input_ids", "input_lengths", "prompt_lengths", "truncated"):
        assert torch.equal(served[key], local[key]), key
    assert not bool(served["truncated"].all())  # a response that ends at EOS keeps it, as in process


def test_vllm_prompt_logprobs_equal_the_in_process_teacher(vllm_server, teacher_model, tokenizer):
    remote = RemoteTeacher(vllm_server, model="demo-teacher", sequences_per_request=2, max_concurrency=2)
    remote.connect(tokenizer)  # /tokenize of a probe text equals the HF tokenizer's ids
    local = LocalTeacher(teacher_model)
    batch = batch_of(tokenizer, TEXTS)
    vocab = len(tokenizer)
    values, ids = remote.get_topk_logprobs(batch, K, 1.0, vocab)
    local_values, local_ids = local.get_topk_logprobs(batch, K, 1.0, vocab)
    largest = 0.0
    for row, n in enumerate(batch["input_lengths"].tolist()):
        difference = (values[row, : n - 1] - local_values[row, : n - 1]).abs()
        largest = max(largest, float(difference.max()))
        assert float(difference.max()) <= 1e-4
        # Ties between near-equal candidates may order differently; the top 3 must not.
        assert torch.equal(ids[row, : n - 1, :3], local_ids[row, : n - 1, :3])
    token = remote.get_token_logprobs(batch, vocab)
    local_token = local.get_token_logprobs(batch, vocab)
    for row, n in enumerate(batch["input_lengths"].tolist()):
        torch.testing.assert_close(token[row, :n], local_token[row, :n], rtol=0, atol=1e-4)
    print(f"largest |served - in-process| top-{K} log-prob difference: {largest:.2e}")
    remote.close()


@pytest.mark.parametrize("loss", ["topk", "sampled_token"])
def test_loss_from_the_vllm_teacher_equals_the_in_process_one(vllm_server, teacher_model, tokenizer, loss):
    torch.manual_seed(0)
    remote = RemoteTeacher(vllm_server, model="demo-teacher")
    remote.connect(tokenizer)
    student = AutoModelForCausalLM.from_pretrained(STUDENT_DIR, dtype=torch.float32)
    served_loss, local_loss = served_and_in_process_losses(
        loss, "forward", batch_of(tokenizer, TEXTS), student, remote, LocalTeacher(teacher_model), K, len(tokenizer),
    )
    assert torch.isfinite(served_loss)
    torch.testing.assert_close(served_loss, local_loss, rtol=1e-4, atol=1e-5)
    remote.close()


def test_the_shipped_served_config_validates_and_trains_against_vllm(vllm_server, task_dir, tmp_path, monkeypatch):
    # Seed 002's case as examples/configs/distillation_math_served.yaml ships it: a top-k loss
    # from a vLLM-served teacher, validated at the start and at the end. Validation asks this
    # teacher for the loss's own top k (it cannot send its full vocabulary); only the models,
    # the data, the sizes and the HF rollout engine (the engine's own tests are elsewhere) are
    # this machine's.
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("OPD_TEACHER_KEY", "unused")  # the config's key variable; this server checks none
    output_dir = tmp_path / "run"
    status = opd_main([
        "train", "--config", str(REPO_ROOT / "examples" / "configs" / "distillation_math_served.yaml"),
        f"output_dir={output_dir}", f"model.student_model_path={STUDENT_DIR}", f"model.tokenizer_path={STUDENT_DIR}",
        f"teacher.remote.url={vllm_server}", "teacher.remote.model=demo-teacher", f"loss_fn.k={K}",
        f"data.train_path={task_dir / 'train.jsonl'}", "data.val_holdout=4", "model.dtype=float32",
        "generation.backend=hf", "training.max_num_steps=1", "training.save_freq=0", "training.batch_size=4",
        "distillation.generate_strategy.max_length=12", "validation.generate_strategy.max_length=12",
        "validation.val_at_start=true", "validation.batch_size=4",
    ])
    assert status == 0
    records = [json.loads(line) for line in (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in records if "val/kl_forward" in r]
    assert [r["step"] for r in validations] == [0, 1]
    assert all(math.isfinite(r["val/kl_forward"]) and math.isfinite(r["val/kl_reverse"]) for r in validations)
    assert [math.isfinite(r["train/loss"]) for r in records if "train/loss" in r] == [True]
