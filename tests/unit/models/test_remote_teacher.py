"""The served teacher: ``opd serve-teacher`` and the remote-teacher client, over real HTTP on 127.0.0.1.

* the answers equal the in-process teacher's, over both protocols (vLLM's JSON and opd's
  binary one): top-k log-probs and ids, the rest mass outside the top k, token
  log-probs, and, over the binary protocol, the final hidden states, from which the
  full-vocabulary losses equal the in-process ones within 1e-5;
* the output layer loaded by the trainer is checked against the server's (shape,
  checksum), and a server without opd's protocol is refused where it is needed;
* the server's refusals (bearer token, oversized body, too many log-probs, text prompts,
  boolean ids, bodies that are not UTF-8 or nested too deeply);
* concurrent requests are coalesced into shared forward passes, with the same answers;
* faults between client and server, injected by a forwarding proxy: HTTP 500s, a slow
  answer, a truncated body, answers that do not match the ids sent, and for binary
  answers a checksum mismatch, a wrong dtype, a wrong shape — retried, or stopped with
  a clear error, never fed to the loss;
* the server process killed mid-run, and restarted within the retry window; SIGTERM
  finishes the request in flight; a port in use is a one-line error;
* a server that flaps during a training run (down, then up on the same port): back within
  the bounded retries, the run goes on as if nothing happened; down for longer, the run
  stops with one error naming the server, its attempts and the checkpoint to resume from,
  and the rerun resumes to the very weights of the run that recovered;
* a distillation run against the served teacher equals the same run with the teacher in
  process, for a top-k and for the exact full-vocabulary loss.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from opd_test_helpers import REPO_ROOT, BackgroundProcess, RunningServer, served_and_in_process_losses
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from opd.cli import main as opd_main
from opd.data.batched_data_dict import BatchedDataDict
from opd.distillation.config import MasterConfig
from opd.distillation.setup import check_environment, setup
from opd.distillation.step import distillation_train
from opd.kernels.topk_rest import rest_logprobs_from_topk
from opd.losses.distillation_losses import JSDLossFn, KLLossFn, TopKKLLossFn
from opd.models.interfaces import FullVocabRequest
from opd.models.lm_head import LMHeadInput, output_layer_of
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.run.logger import Logger
from opd.teachers.backends import RemoteTeacherConfig
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.scoring import PromptScorer
from opd.teachers.served import wire
from opd.teachers.served.remote_generation import RemoteGeneration
from opd.teachers.served.remote_teacher import RemoteTeacher, TeacherServiceError
from opd.teachers.served.server import REST_MASS_FIELD, TeacherService
from opd.utils.config import load_config
from opd.utils.errors import ConfigError

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
K = 8
PROTOCOLS = ["openai", "opd"]


# ------------------------------------------------------------------------------ fixtures


class ThreadedHTTP:
    """A stdlib HTTP server (the fault proxy) serving in a background thread."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def teacher_model():
    return build_tiny_model("teacher").eval()


def make_service(teacher_model, tokenizer, max_logprobs: int = 128) -> TeacherService:
    return TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny-teacher", max_logprobs, 512)


@pytest.fixture(scope="module")
def served(teacher_model, tokenizer):
    running = RunningServer(make_service(teacher_model, tokenizer))
    yield running
    running.stop()


def batch_of(tokenizer, texts: list[str]) -> BatchedDataDict:
    """Right-padded rows of different lengths (the layout every stage uses)."""
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        + text
        for text in texts
    ]
    ids = [tokenizer(row, add_special_tokens=False)["input_ids"] for row in rows]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    for row, sequence in enumerate(ids):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
    lengths = torch.tensor([len(sequence) for sequence in ids])
    mask = torch.zeros_like(input_ids, dtype=torch.float32)
    for row, n in enumerate(lengths):
        mask[row, 3:n] = 1.0  # loss on all but the first few tokens
    return BatchedDataDict(input_ids=input_ids, input_lengths=lengths, token_mask=mask)


TEXTS = ["What is 2 + 3?", "hi", "Count to five, please, and then stop now."]


def client(url: str, **overrides) -> RemoteTeacher:
    settings = {
        "max_concurrency": 2,
        "sequences_per_request": 2,
        "timeout_s": 10.0,
        "max_retries": 3,
        "backoff_s": 0.01,
    }
    settings.update(overrides)
    return RemoteTeacher(url, **settings)


def connected(url: str, tokenizer, **overrides) -> RemoteTeacher:
    remote = client(url, **overrides)
    remote.connect(tokenizer)
    return remote


# ------------------------------------------------------------------- equal to in-process


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_served_topk_and_token_logprobs_equal_the_in_process_teacher(served, teacher_model, tokenizer, protocol):
    batch = batch_of(tokenizer, TEXTS)
    remote = connected(served.url, tokenizer, protocol=protocol)
    assert remote.protocol == protocol
    local = LocalTeacher(teacher_model)
    vocab = len(tokenizer)
    answer = remote.get_topk_logprobs(batch, K, 1.0, vocab)
    local_answer = local.get_topk_logprobs(batch, K, 1.0, vocab)
    values, ids = answer
    local_values, local_ids = local_answer
    assert answer.rest_logprobs is not None and local_answer.rest_logprobs is not None
    mask = batch["token_mask"]
    for row, n in enumerate(batch["input_lengths"].tolist()):
        # The binary protocol scores the positions that predict a loss token (from the
        # one before the first masked token); JSON scores every position but the last.
        first = int(mask[row].nonzero()[0, 0]) - 1 if protocol == "opd" else 0
        scored = slice(first, n - 1)
        torch.testing.assert_close(values[row, scored], local_values[row, scored], rtol=0, atol=1e-4)
        assert torch.equal(ids[row, scored], local_ids[row, scored])
        assert torch.isfinite(values[row]).all()
        # The server's own rest mass, not one the client subtracted.
        torch.testing.assert_close(
            answer.rest_logprobs[row, scored], local_answer.rest_logprobs[row, scored], rtol=0, atol=1e-4
        )
        assert torch.isfinite(answer.rest_logprobs[row]).all()
    token = remote.get_token_logprobs(batch, vocab)
    local_token = local.get_token_logprobs(batch, vocab)
    for row, n in enumerate(batch["input_lengths"].tolist()):
        first = int(mask[row].nonzero()[0, 0]) if protocol == "opd" else 1
        torch.testing.assert_close(token[row, first:n], local_token[row, first:n], rtol=0, atol=1e-4)
        assert (token[row, n:] == 0).all()
    remote.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("loss", ["topk", "sampled_token"])
def test_loss_from_the_served_teacher_equals_the_in_process_one(served, teacher_model, tokenizer, loss, protocol):
    torch.manual_seed(0)
    remote = connected(served.url, tokenizer, protocol=protocol)
    served_loss, local_loss = served_and_in_process_losses(
        loss,
        "reverse",
        batch_of(tokenizer, TEXTS),
        build_tiny_model("student"),
        remote,
        LocalTeacher(teacher_model),
        K,
        len(tokenizer),
    )
    assert torch.isfinite(served_loss)
    torch.testing.assert_close(served_loss, local_loss, rtol=1e-5, atol=1e-6)
    remote.close()


def teacher_layer(teacher_model):
    layer = output_layer_of(teacher_model)
    return type(layer)(layer.weight.detach().clone(), None, layer.logit_multiplier, layer.logit_softcap)


@pytest.mark.parametrize(
    "kl_type, divergence, fused",
    [
        ("forward", "kl", True),
        ("reverse", "kl", True),
        ("mixed", "kl", True),
        ("reverse", "jsd", True),
        ("mixed", "kl", False),
    ],
)
def test_full_vocabulary_loss_from_served_hidden_states_equals_the_in_process_loss(
    served, teacher_model, tokenizer, kl_type, divergence, fused
):
    """Exact: the server sends fp32 hidden states, the trainer applies the teacher's head."""
    remote = connected(
        served.url, tokenizer, protocol="opd", hidden_dtype="float32", output_layer=teacher_layer(teacher_model)
    )
    local = LocalTeacher(teacher_model)
    batch = batch_of(tokenizer, TEXTS)
    student = build_tiny_model("student")
    loss_fn = (
        JSDLossFn(vocab_size=len(tokenizer), fused_lm_head=fused)
        if divergence == "jsd"
        else KLLossFn(kl_type=kl_type, mixed_kl_weight=0.3, vocab_size=len(tokenizer), fused_lm_head=fused)
    )
    request = loss_fn.teacher_request
    assert isinstance(request, FullVocabRequest) and request.prefer_hidden_states == fused
    served_signal, local_signal = remote.score(batch, request), local.score(batch, request)
    assert isinstance(served_signal, LMHeadInput) == fused
    valid = int(batch["token_mask"][:, 1:].sum())
    losses = []
    for signal_ in (served_signal, local_signal):
        student.zero_grad()
        if fused:
            hidden = student.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state
            output = LMHeadInput(hidden, student.lm_head.weight)
        else:
            output = student(input_ids=batch["input_ids"]).logits
        loss, _ = loss_fn(output, batch, valid, batch.size, teacher_output=signal_)
        loss.backward()
        losses.append((loss.detach(), student.lm_head.weight.grad.clone()))
    (served_loss, served_grad), (local_loss, local_grad) = losses
    assert float(local_loss) > 0
    torch.testing.assert_close(served_loss, local_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(served_grad, local_grad, rtol=1e-5, atol=1e-7)
    remote.close()


def test_hidden_states_in_bfloat16_cost_half_the_bytes_and_stay_close(served, teacher_model, tokenizer):
    batch = batch_of(tokenizer, TEXTS)
    sizes, heads = {}, {}
    for dtype in ("float32", "bfloat16"):
        remote = connected(
            served.url,
            tokenizer,
            protocol="opd",
            hidden_dtype=dtype,
            output_layer=teacher_layer(teacher_model),
            sequences_per_request=len(TEXTS),
        )
        before = remote.bytes_received
        heads[dtype] = remote.get_hidden_states(batch)
        sizes[dtype] = remote.bytes_received - before
        remote.close()
    rows = int(sum(batch["input_lengths"] - 1 - (batch["token_mask"].argmax(dim=1) - 1)))
    width = teacher_model.config.hidden_size
    # The payload is the hidden rows plus a small header and the echoed ids.
    assert rows * width * 4 < sizes["float32"] < rows * width * 4 + 2048
    assert rows * width * 2 < sizes["bfloat16"] < rows * width * 2 + 2048
    scored = batch["token_mask"][:, 1:].bool()
    exact = heads["float32"].hidden_states[:, :-1][scored]
    rounded = heads["bfloat16"].hidden_states[:, :-1][scored]
    torch.testing.assert_close(rounded, exact.bfloat16().float(), rtol=0, atol=0)


def test_the_full_vocabulary_needs_opds_protocol_and_the_right_output_layer(served, teacher_model, tokenizer):
    batch = batch_of(tokenizer, TEXTS)
    with pytest.raises(TeacherServiceError, match="needs opd serve-teacher"):
        connected(served.url, tokenizer, protocol="openai").score(batch, FullVocabRequest())
    with pytest.raises(TeacherServiceError, match="speaks vLLM's JSON"):
        connected(served.url, tokenizer, protocol="openai", output_layer=teacher_layer(teacher_model))
    student = output_layer_of(build_tiny_model("student"))
    with pytest.raises(TeacherServiceError, match="the served model's is"):
        connected(served.url, tokenizer, output_layer=type(student)(student.weight.detach()))
    perturbed = teacher_layer(teacher_model)
    perturbed.weight[3, 5] += 1e-3
    with pytest.raises(TeacherServiceError, match=r"checksum sha256:.*model.teacher_model_path must hold the weights"):
        connected(served.url, tokenizer, output_layer=perturbed)


def test_a_served_teacher_answers_top_k_only_at_temperature_one(served, tokenizer):
    with pytest.raises(TeacherServiceError, match="temperature 1"):
        client(served.url).get_topk_logprobs(batch_of(tokenizer, TEXTS), K, 2.0)


# ---------------------------------------------------------------------- server refusals


def test_bearer_token_is_required_when_configured(teacher_model, tokenizer):
    running = RunningServer(make_service(teacher_model, tokenizer), api_key="s3cret")
    try:
        with pytest.raises(TeacherServiceError, match="HTTP 401"):
            client(running.url).connect(tokenizer)
        with pytest.raises(TeacherServiceError, match="HTTP 401"):
            client(running.url, api_key="wrong").connect(tokenizer)
        good = client(running.url, api_key="s3cret")
        good.connect(tokenizer)
        assert good.get_token_logprobs(batch_of(tokenizer, TEXTS)).shape[0] == len(TEXTS)
    finally:
        running.stop()


def test_oversized_requests_are_rejected_before_reading(teacher_model, tokenizer):
    running = RunningServer(make_service(teacher_model, tokenizer), max_request_bytes=200)
    try:
        response = httpx.post(
            f"{running.url}/v1/completions", json={"prompt": list(range(100)), "max_tokens": 1, "prompt_logprobs": 1}
        )
        assert response.status_code == 413
        assert "exceeds the server's limit of 200" in response.json()["error"]["message"]
        with pytest.raises(TeacherServiceError, match="HTTP 413"):
            client(running.url).get_token_logprobs(batch_of(tokenizer, TEXTS))
    finally:
        running.stop()


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "text", "max_tokens": 1, "prompt_logprobs": 1}, "scores token ids, not text"),
        ({"prompt": [1, 2], "max_tokens": 5, "prompt_logprobs": 1}, "set 'max_tokens' to 1"),
        ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 500}, "--max-logprobs"),
        ({"prompt": [1, 10**9], "max_tokens": 1, "prompt_logprobs": 1}, "token ids in"),
        ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 1, "model": "other"}, "not served here"),
    ],
)
def test_malformed_requests_get_a_4xx_with_a_reason(served, body, message):
    response = httpx.post(f"{served.url}/v1/completions", json=body)
    assert 400 <= response.status_code < 500
    assert message in response.json()["error"]["message"]


def test_a_client_built_without_a_timeout_waits_as_long_as_the_configs_default():
    default = RemoteTeacherConfig().timeout_s
    clients = (RemoteTeacher("http://127.0.0.1:9"), RemoteGeneration("http://127.0.0.1:9", None, None, [2], 0))
    for client in clients:  # never connected: nothing is sent
        try:
            assert client._client.timeout == httpx.Timeout(default), type(client).__name__
        finally:
            client.close()


def test_a_tokenizer_mismatch_stops_at_connect(served, tokenizer):
    class Shifted:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [token + 1 for token in tokenizer(text, add_special_tokens=False)["input_ids"]]}

    with pytest.raises(TeacherServiceError, match="tokenizes differently"):
        client(served.url).connect(Shifted())
    with pytest.raises(TeacherServiceError, match="does not serve 'other'"):
        client(served.url, model="other").connect(tokenizer)


# ------------------------------------------------------------------------ injected faults


class FaultProxy:
    """Forwards requests to the real server, misbehaving on the scoring requests named in ``faults``.

    ``faults`` is consumed one entry per scoring request (``/v1/completions`` or
    ``/opd/v1/score``): ``ok``, ``500``, ``slow`` (waits 2 s, longer than the client's
    timeout), ``truncate`` (announces the full length, sends half the body, closes),
    ``misalign`` (reports other token ids). JSON answers only: ``short`` (drops the last
    position's log-probs), ``vllm`` (drops the rest masses, which vLLM does not send),
    ``bad_rest`` (a rest mass that does not add up with the top k to 1). Binary answers
    only: ``checksum`` (one byte of a tensor flipped), ``dtype`` (a tensor re-encoded in
    another dtype, with a valid checksum), ``shape`` (a row dropped, with a valid checksum).
    ``no_opd`` on the proxy hides opd's protocol (HTTP 404 for ``/opd/v1/*``, as from vLLM).
    """

    def __init__(self, target: str, faults: list[str], no_opd: bool = False) -> None:
        self.faults = list(faults)
        self.seen = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                return None

            def _forward(self, method: str) -> httpx.Response:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
                return httpx.request(
                    method, f"{target}{self.path}", content=body or None, headers={"Content-Type": "application/json"}
                )

            def _send(
                self, status: int, data: bytes, length: int | None = None, media_type: str = "application/json"
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if no_opd and self.path.startswith("/opd/"):
                    self._send(404, b'{"error": {"message": "Not Found"}}')
                    return
                response = self._forward("GET")
                self._send(response.status_code, response.content)

            def do_POST(self) -> None:
                if self.path not in ("/v1/completions", wire.SCORE_PATH):
                    response = self._forward("POST")
                    self._send(response.status_code, response.content)
                    return
                fault = proxy.faults.pop(0) if proxy.faults else "ok"
                proxy.seen += 1
                if fault == "500":
                    self.rfile.read(int(self.headers["Content-Length"]))
                    self._send(500, b'{"error": {"message": "engine crashed"}}')
                    return
                if fault == "slow":
                    time.sleep(2.0)
                response = self._forward("POST")
                if self.path == wire.SCORE_PATH:
                    data, media_type = damaged_binary(response.content, fault), wire.MEDIA_TYPE
                else:
                    data, media_type = damaged_json(response.json(), fault), "application/json"
                if fault == "truncate":
                    self._send(200, data[: len(data) // 2], length=len(data), media_type=media_type)
                    self.close_connection = True
                    return
                self._send(response.status_code, data, media_type=media_type)

        self.running = ThreadedHTTP(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        self.running.server.daemon_threads = True
        self.url = self.running.url


def damaged_json(payload: dict, fault: str) -> bytes:
    if fault == "misalign":
        payload["choices"][0]["prompt_token_ids"][1] += 1
    if fault == "short":
        payload["choices"][0]["prompt_logprobs"].pop()
    if fault == "vllm":
        for choice in payload["choices"]:
            choice.pop(REST_MASS_FIELD, None)
    if fault == "bad_rest":
        payload["choices"][0][REST_MASS_FIELD][1] = 0.5
    return json.dumps(payload).encode()


def damaged_binary(body: bytes, fault: str) -> bytes:
    if fault == "checksum":
        damaged = bytearray(body)
        damaged[-3] ^= 0x40  # inside the last tensor's bytes
        return bytes(damaged)
    if fault not in ("misalign", "dtype", "shape"):
        return body
    tensors = load_safetensors(body)
    signal_ = wire._metadata(body)["signal"]
    if fault == "misalign":
        tensors["token_ids"][1] += 1
    name = next(name for name in sorted(tensors) if name not in ("token_ids", "lengths", "first_positions"))
    if fault == "dtype":
        tensors[name] = tensors[name].to(torch.float16 if tensors[name].is_floating_point() else torch.int64)
    if fault == "shape":
        tensors[name] = tensors[name][1:]
    # Re-encoded with a valid checksum: the client must notice the content, not the damage.
    return save_safetensors(
        tensors, metadata={"format": wire.FORMAT, "signal": signal_, "checksum": wire.checksum(tensors)}
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("faults", [["500", "500"], ["slow"], ["truncate"], ["500", "truncate", "slow"]])
def test_transient_faults_are_retried_and_the_answer_is_exact(served, teacher_model, tokenizer, faults, protocol):
    proxy = FaultProxy(served.url, faults)
    batch = batch_of(tokenizer, TEXTS)
    try:
        remote = connected(
            proxy.url, tokenizer, timeout_s=1.0, sequences_per_request=len(TEXTS), max_concurrency=1, protocol=protocol
        )
        token = remote.get_token_logprobs(batch, len(tokenizer))
    finally:
        proxy.running.stop()
    assert remote.retries == len(faults)
    expected = LocalTeacher(teacher_model).get_token_logprobs(batch, len(tokenizer))
    mask = batch["token_mask"]
    for row, n in enumerate(batch["input_lengths"].tolist()):
        first = int(mask[row].nonzero()[0, 0]) if protocol == "opd" else 1
        torch.testing.assert_close(token[row, first:n], expected[row, first:n], rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "protocol, fault, message",
    [
        ("openai", "misalign", "scored other token ids than were sent"),
        ("openai", "short", "prompt_logprobs entries for"),
        ("openai", "500", "HTTP 500"),
        ("openai", "bad_rest", "do not add up to 1"),
        ("opd", "misalign", "scored other token ids than were sent"),
        ("opd", "checksum", "checksum mismatch"),
        ("opd", "dtype", "rest_logprobs is torch.float16, expected torch.float64"),
        ("opd", "shape", "has shape"),
        ("opd", "truncate", "(truncated|RemoteProtocol|incomplete)"),
    ],
)
def test_persistent_faults_stop_with_a_clear_error_and_nothing_reaches_the_loss(
    served, tokenizer, protocol, fault, message
):
    proxy = FaultProxy(served.url, [fault] * 10)
    loss_fn = TopKKLLossFn(kl_type="reverse", k=K, vocab_size=len(tokenizer))
    batch = batch_of(tokenizer, TEXTS)
    reached_loss = []
    try:
        remote = connected(proxy.url, tokenizer, max_retries=2, sequences_per_request=len(TEXTS), protocol=protocol)
        with pytest.raises(TeacherServiceError, match=message) as raised:
            reached_loss.append(remote.score(batch, loss_fn.teacher_request))
    finally:
        proxy.running.stop()
    assert reached_loss == []
    assert "after 3 attempts" in str(raised.value)
    assert proxy.seen == 3


def test_a_server_without_opds_protocol_falls_back_to_json_or_is_refused(served, tokenizer):
    proxy = FaultProxy(served.url, [], no_opd=True)
    try:
        assert connected(proxy.url, tokenizer).protocol == "openai"  # auto
        with pytest.raises(TeacherServiceError, match="does not speak opd's binary protocol"):
            connected(proxy.url, tokenizer, protocol="opd")
    finally:
        proxy.running.stop()


def test_without_served_rest_masses_the_client_computes_them_from_the_top_k(served, teacher_model, tokenizer):
    """A vLLM server sends no rest mass: the client takes log(1 − Σ_k P) in float64 from the top k."""
    proxy = FaultProxy(served.url, ["vllm"] * 10)
    batch = batch_of(tokenizer, TEXTS)
    vocab = len(tokenizer)
    try:
        remote = connected(proxy.url, tokenizer, sequences_per_request=len(TEXTS), protocol="openai")
        answer = remote.get_topk_logprobs(batch, K, 1.0, vocab)
    finally:
        proxy.running.stop()
    local = LocalTeacher(teacher_model).get_topk_logprobs(batch, K, 1.0, vocab)
    assert answer.rest_logprobs is not None and local.rest_logprobs is not None
    for row, n in enumerate(batch["input_lengths"].tolist()):
        received = answer.logprobs[row, : n - 1]
        torch.testing.assert_close(
            answer.rest_logprobs[row, : n - 1], rest_logprobs_from_topk(received).float(), rtol=0, atol=1e-6
        )
        torch.testing.assert_close(
            answer.rest_logprobs[row, : n - 1], local.rest_logprobs[row, : n - 1], rtol=0, atol=1e-4
        )


def test_the_server_sends_rest_masses_only_with_top_k(served):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": 3}
    choice = httpx.post(f"{served.url}/v1/completions", json=body).json()["choices"][0]
    rest = choice[REST_MASS_FIELD]
    assert rest[0] is None and len(rest) == 4
    for position in range(1, 4):
        entries = choice["prompt_logprobs"][position]
        top = sorted((info["logprob"] for info in entries.values()), reverse=True)[:3]
        assert 0.0 < rest[position] < 1.0
        assert math.fsum(math.exp(value) for value in top) + rest[position] == pytest.approx(1.0, abs=1e-5)
    token_only = httpx.post(f"{served.url}/v1/completions", json={**body, "prompt_logprobs": 0}).json()
    assert REST_MASS_FIELD not in token_only["choices"][0]


# ------------------------------------------------------------------ a real server process


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server_process(tmp_path: Path, port: int, name: str) -> BackgroundProcess:
    process = BackgroundProcess(
        name,
        [sys.executable, "-m", "opd", "serve-teacher", "--model", "tiny:teacher", "--port", str(port)],
        tmp_path,
        dict(os.environ),
        timeout=120,
    )
    process.wait_until(lambda: "serving" in process.stdout, "the server to start")
    return process


def test_server_killed_mid_run_stops_with_a_clear_error_and_a_restart_is_picked_up(tmp_path, tokenizer, teacher_model):
    port = free_port()
    first = start_server_process(tmp_path, port, "server1")
    restarted: list[BackgroundProcess] = []
    batch = batch_of(tokenizer, TEXTS)
    remote = client(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.05)
    try:
        remote.connect(tokenizer)
        before = remote.get_token_logprobs(batch)
        first.send(signal.SIGKILL)
        first.wait()
        with pytest.raises(TeacherServiceError, match=r"after 3 attempts.*(Connect|Remote|Read)"):
            remote.get_token_logprobs(batch)
        # Restarted while the client is backing off: the same request then succeeds.
        slow_retry = client(f"http://127.0.0.1:{port}", max_retries=8, backoff_s=0.5, protocol="opd")
        restarter = threading.Thread(target=lambda: restarted.append(start_server_process(tmp_path, port, "server2")))
        restarter.start()
        after = slow_retry.get_token_logprobs(batch)
        restarter.join()
        assert slow_retry.retries >= 1
        # Another process computes it: equal to float32 rounding (kernels may depend on alignment).
        torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    finally:
        first.stop_if_running()
        for process in restarted:
            process.stop_if_running()


# ------------------------------------------------------------------ a server that flaps during a run


FLAP_STEPS = 4
FLAP_RETRIES = 4
FLAP_OVERRIDES = [
    f"data.train_path={TRAIN_DATA}",
    "data.val_path=null",
    "validation.val_at_start=false",
    "validation.val_at_end=false",
    "logger.console=false",
    "training.batch_size=2",
    "training.micro_batch_size=null",
    f"training.max_num_steps={FLAP_STEPS}",
    "training.save_freq=2",
    "distillation.generate_strategy.max_length=8",
    "loss_fn.type=topk",
    f"loss_fn.k={K}",
    "teacher.backend=remote",
    # One request at a time, the whole batch in it: the server answers each step's batch alone, so every
    # run's answers are bitwise alike (coalesced requests would be padded by what else arrived).
    "teacher.remote.max_concurrency=1",
    "teacher.remote.sequences_per_request=16",
    f"teacher.remote.max_retries={FLAP_RETRIES}",
    "teacher.remote.backoff_s=0.2",
]


class FlappingServer:
    """The served teacher on one port of 127.0.0.1, taken down (connections refused) and brought up again.

    Each start serves a new ``make_service()``, as a restarted server process would (a stopped
    server's service has stopped its batcher).
    """

    def __init__(self, make_service) -> None:
        self.make_service = make_service
        self.running: RunningServer | None = RunningServer(make_service())
        self.port = self.running.port
        self.downs = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        assert self.running is not None
        self.running.stop()
        self.running = None
        self.downs += 1

    def up(self) -> None:
        self.running = RunningServer(self.make_service(), port=self.port)

    def close(self) -> None:
        if self.running is not None:
            self.running.stop()


class RetryWarnings(logging.Handler):
    """Counts the served-teacher client's retry warnings; ``first`` is set at the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying in" in record.getMessage():
            self.count += 1
            self.first.set()


@pytest.fixture
def retry_warnings():
    handler = RetryWarnings()
    client_log = logging.getLogger("opd.teachers.served.remote_teacher")
    client_log.addHandler(handler)
    yield handler
    client_log.removeHandler(handler)


def down_after_step(monkeypatch, server: FlappingServer, step: int) -> None:
    """Takes ``server`` down once the training record of ``step`` is written (before step + 1 asks the teacher)."""
    original = Logger.log_metrics

    def log_metrics(self, metrics, logged_step, *args, **kwargs):
        original(self, metrics, logged_step, *args, **kwargs)
        if logged_step == step and "train/loss" in metrics and server.running is not None:
            server.down()

    monkeypatch.setattr(Logger, "log_metrics", log_metrics)


def train_records(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["train/loss"] for record in map(json.loads, lines) if "train/loss" in record}


def test_a_teacher_that_flaps_during_a_run_is_retried_then_recovered_or_stopped_resumably(
    tmp_path, teacher_model, tokenizer, capsys, monkeypatch, retry_warnings
):
    server = FlappingServer(lambda: make_service(teacher_model, tokenizer))

    def train(name: str) -> tuple[int, str]:
        status = opd_main(
            [
                "train",
                "--config",
                str(TINY_CONFIG),
                f"output_dir={tmp_path / name}",
                f"teacher.remote.url={server.url}",
                *FLAP_OVERRIDES,
            ]
        )
        return status, capsys.readouterr().err

    try:
        # Down after step 2, up again at the first retry: within the retries, the run never notices.
        down_after_step(monkeypatch, server, 2)
        restarter = threading.Thread(target=lambda: retry_warnings.first.wait(timeout=60) and server.up())
        restarter.start()
        status, err = train("recovered")
        restarter.join(timeout=60)
        assert status == 0, err
        assert server.downs == 1 and server.running is not None
        assert 1 <= retry_warnings.count <= FLAP_RETRIES, err
        assert sorted(train_records(tmp_path / "recovered")) == list(range(1, FLAP_STEPS + 1))

        # Down after step 3 and left down: after its bounded retries the run stops, saying where to resume.
        monkeypatch.undo()
        down_after_step(monkeypatch, server, 3)
        retry_warnings.count = 0
        status, err = train("stopped")
        assert status == 2 and "Traceback" not in err, err
        assert server.downs == 2 and server.running is None
        assert retry_warnings.count == FLAP_RETRIES  # bounded: one request, retried FLAP_RETRIES times
        lines = [line for line in err.splitlines() if line.startswith("opd: error:")]
        assert len(lines) == 1, err
        newest = tmp_path / "stopped" / "checkpoints" / "step_2"
        assert f"teacher server {server.url}" in lines[0] and f"after {FLAP_RETRIES + 1} attempts" in lines[0]
        assert f"after step 3 of {FLAP_STEPS}; the newest complete checkpoint is {newest}" in lines[0]
        assert lines[0].endswith("rerun the same command to resume")

        # Up again: the same command resumes from step_2 and ends where the recovered run ended, bit for bit.
        monkeypatch.undo()
        server.up()
        status, err = train("stopped")
        assert status == 0, err
        assert f"resuming from {newest}" in err
    finally:
        server.close()
    assert train_records(tmp_path / "stopped") == train_records(tmp_path / "recovered")
    final = {
        name: (tmp_path / name / "final_model" / "model.safetensors").read_bytes() for name in ("recovered", "stopped")
    }
    assert final["stopped"] == final["recovered"]


# ------------------------------------------------------------------ distillation, end to end


@pytest.mark.parametrize(
    "loss",
    [["loss_fn.type=topk", f"loss_fn.k={K}"], ["loss_fn.type=full_vocab", "teacher.remote.hidden_dtype=float32"]],
)
def test_distillation_with_the_served_teacher_equals_the_in_process_run(served, tmp_path, loss):
    common = [
        f"data.train_path={TRAIN_DATA}",
        "data.val_path=null",
        "validation.val_at_start=false",
        "validation.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.console=false",
        "training.batch_size=2",
        "training.micro_batch_size=null",
        "training.warmup_steps=0",
        "training.max_num_steps=3",
        "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8",
        *loss,
    ]
    losses = {}
    for name, extra in (
        ("local", []),
        ("remote", ["teacher.backend=remote", f"teacher.remote.url={served.url}", "teacher.remote.backoff_s=0.01"]),
    ):
        config = load_config(MasterConfig, TINY_CONFIG, [*common, f"output_dir={tmp_path / name}", *extra])
        parts = setup(config)
        assert isinstance(parts.teacher_policy, RemoteTeacher if name == "remote" else LocalTeacher)
        distillation_train(parts)
        records = [json.loads(line) for line in (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [record["train/loss"] for record in records if "train/loss" in record]
    assert len(losses["remote"]) == 3
    assert all(math.isfinite(value) for value in losses["remote"])
    # The exact loss from hidden states is held to the 1e-5; top-k to its float32 rounding.
    tolerance = 1e-5 if "loss_fn.type=full_vocab" in loss else 1e-4
    assert losses["remote"] == pytest.approx(losses["local"], rel=tolerance, abs=1e-7)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["teacher.backend=remote"], "needs teacher.remote.url"),
        (
            [
                "teacher.backend=remote",
                "teacher.remote.url=http://127.0.0.1:1",
                "loss_fn.type=full_vocab",
                "teacher.remote.protocol=openai",
            ],
            "vLLM's JSON does not carry",
        ),
        (
            [
                "teacher.backend=remote",
                "teacher.remote.url=http://127.0.0.1:1",
                "loss_fn.type=full_vocab",
                "model.teacher_model_path=null",
            ],
            "set model.teacher_model_path to the served model's directory",
        ),
        (
            [
                "teacher.backend=remote",
                "teacher.remote.url=http://127.0.0.1:1",
                "loss_fn.type=topk",
                "loss_fn.temperature=2.0",
            ],
            "answers top-k at temperature 1",
        ),
        (
            [
                "teacher.backend=remote",
                "teacher.remote.url=http://127.0.0.1:1",
                "loss_fn.type=topk",
                "teacher.remote.api_key_env=OPD_TEST_UNSET_KEY",
            ],
            "OPD_TEST_UNSET_KEY",
        ),
        (["model.teacher_model_path=null"], "model.teacher_model_path is required"),
    ],
)
def test_teacher_config_mistakes_name_the_keys(tmp_path, overrides, message, monkeypatch):
    monkeypatch.delenv("OPD_TEST_UNSET_KEY", raising=False)
    # Cross-section mistakes stop the config's validation; an unset API key variable stops
    # the environment check that setup runs before anything is loaded.
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = load_config(
            MasterConfig, TINY_CONFIG, [f"output_dir={tmp_path}", f"data.train_path={TRAIN_DATA}", *overrides]
        )
        check_environment(config)


def test_an_unreachable_teacher_server_fails_setup_before_the_student_loads(tmp_path):
    config = load_config(
        MasterConfig,
        TINY_CONFIG,
        [
            f"output_dir={tmp_path / 'run'}",
            f"data.train_path={TRAIN_DATA}",
            "data.val_path=null",
            "teacher.backend=remote",
            f"teacher.remote.url=http://127.0.0.1:{free_port()}",
            "loss_fn.type=topk",
            "teacher.remote.max_retries=1",
            "teacher.remote.backoff_s=0.01",
        ],
    )
    with pytest.raises(TeacherServiceError, match="/v1/models gave no usable answer after 2 attempts"):
        setup(config)
