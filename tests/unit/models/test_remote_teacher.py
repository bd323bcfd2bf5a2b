"""The served teacher: ``opd serve-teacher`` and the remote-teacher client, over real HTTP on 127.0.0.1.

* the answers equal the in-process teacher's (top-k log-probs and ids, the rest mass
  outside the top k, token log-probs), and so does the loss built from them;
* the rest mass: sent by ``opd serve-teacher`` and checked by the client, or computed by
  the client from the top-k when the server does not send it (as vLLM does not);
* the server's refusals (bearer token, oversized body, too many log-probs, text prompts);
* faults between client and server, injected by a forwarding proxy: HTTP 500s, a slow
  answer, a truncated body, answers that do not match the ids sent — retried, or
  stopped with a clear error, never fed to the loss;
* the server process killed mid-run, and restarted within the retry window;
* a distillation run against the served teacher equals the same run with the teacher in
  process.
"""

from __future__ import annotations

import json
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

from opd.algorithms.distillation import distillation_train
from opd.algorithms.distillation_config import MasterConfig
from opd.algorithms.distillation_setup import check_environment, setup
from opd.algorithms.loss_functions import DistillationLossFn
from opd.data.batched_data_dict import BatchedDataDict
from opd.models.interfaces import FullVocabRequest
from opd.models.teacher.local_teacher import LocalTeacher
from opd.models.teacher.remote_teacher import RemoteTeacher, TeacherServiceError
from opd.models.teacher.scoring import PromptScorer
from opd.models.teacher.server import REST_MASS_FIELD, TeacherService, build_server
from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.models.topk_rest import rest_logprobs_from_topk
from opd.utils.config import load_config
from opd.utils.errors import ConfigError
from opd_test_helpers import REPO_ROOT, BackgroundProcess, served_and_in_process_losses

TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "distillation_tiny.yaml"
TRAIN_DATA = REPO_ROOT / "examples" / "data" / "tiny_arithmetic" / "train.jsonl"
K = 8


# ------------------------------------------------------------------------------ fixtures


class RunningServer:
    """An HTTP server on 127.0.0.1 serving in a background thread."""

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
    running = RunningServer(build_server(make_service(teacher_model, tokenizer), port=0))
    yield running
    running.stop()


def batch_of(tokenizer, texts: list[str]) -> BatchedDataDict:
    """Right-padded rows of different lengths (the layout every stage uses)."""
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True) + text for text in texts]
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
    settings = {"max_concurrency": 2, "sequences_per_request": 2, "timeout_s": 10.0, "max_retries": 3,
                "backoff_s": 0.01}
    settings.update(overrides)
    return RemoteTeacher(url, **settings)


# ------------------------------------------------------------------- equal to in-process


def test_served_topk_and_token_logprobs_equal_the_in_process_teacher(served, teacher_model, tokenizer):
    batch = batch_of(tokenizer, TEXTS)
    remote = client(served.url)
    remote.connect(tokenizer)
    local = LocalTeacher(teacher_model)
    vocab = len(tokenizer)
    answer = remote.get_topk_logprobs(batch, K, 1.0, vocab)
    local_answer = local.get_topk_logprobs(batch, K, 1.0, vocab)
    values, ids = answer
    local_values, local_ids = local_answer
    assert answer.rest_logprobs is not None and local_answer.rest_logprobs is not None
    lengths = batch["input_lengths"]
    for row, n in enumerate(lengths.tolist()):
        # Positions 0 … n-2 predict a real token; the rest are placeholders (masked).
        torch.testing.assert_close(values[row, : n - 1], local_values[row, : n - 1], rtol=0, atol=1e-4)
        assert torch.equal(ids[row, : n - 1], local_ids[row, : n - 1])
        assert torch.isfinite(values[row]).all()
        # The server's own rest mass, not one the client subtracted.
        torch.testing.assert_close(answer.rest_logprobs[row, : n - 1], local_answer.rest_logprobs[row, : n - 1],
                                   rtol=0, atol=1e-4)
        assert torch.isfinite(answer.rest_logprobs[row]).all()
    token = remote.get_token_logprobs(batch, vocab)
    local_token = local.get_token_logprobs(batch, vocab)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(token[row, :n], local_token[row, :n], rtol=0, atol=1e-4)
        assert (token[row, n:] == 0).all()
    remote.close()


@pytest.mark.parametrize("loss", ["topk", "sampled_token"])
def test_loss_from_the_served_teacher_equals_the_in_process_one(served, teacher_model, tokenizer, loss):
    torch.manual_seed(0)
    remote = client(served.url)
    remote.connect(tokenizer)
    served_loss, local_loss = served_and_in_process_losses(
        loss, "reverse", batch_of(tokenizer, TEXTS), build_tiny_model("student"), remote, LocalTeacher(teacher_model),
        K, len(tokenizer),
    )
    assert torch.isfinite(served_loss)
    torch.testing.assert_close(served_loss, local_loss, rtol=1e-5, atol=1e-6)
    remote.close()


def test_full_vocabulary_logits_are_refused(served, tokenizer):
    with pytest.raises(TeacherServiceError, match="not its full vocabulary"):
        client(served.url).score(batch_of(tokenizer, TEXTS), FullVocabRequest())


def test_a_served_teacher_answers_only_at_temperature_one(served, tokenizer):
    with pytest.raises(TeacherServiceError, match="temperature 1"):
        client(served.url).get_topk_logprobs(batch_of(tokenizer, TEXTS), K, 2.0)


# ---------------------------------------------------------------------- server refusals


def test_bearer_token_is_required_when_configured(teacher_model, tokenizer):
    running = RunningServer(build_server(make_service(teacher_model, tokenizer), port=0, api_key="s3cret"))
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
    running = RunningServer(build_server(make_service(teacher_model, tokenizer), port=0, max_request_bytes=200))
    try:
        response = httpx.post(f"{running.url}/v1/completions", json={"prompt": list(range(100)), "max_tokens": 1,
                                                                      "prompt_logprobs": 1})
        assert response.status_code == 413
        assert "exceeds the server's limit of 200" in response.json()["error"]["message"]
        with pytest.raises(TeacherServiceError, match="HTTP 413"):
            client(running.url).get_token_logprobs(batch_of(tokenizer, TEXTS))
    finally:
        running.stop()


@pytest.mark.parametrize("body, message", [
    ({"prompt": "text", "max_tokens": 1, "prompt_logprobs": 1}, "scores token ids, not text"),
    ({"prompt": [1, 2], "max_tokens": 5, "prompt_logprobs": 1}, "set 'max_tokens' to 1"),
    ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 500}, "--max-logprobs"),
    ({"prompt": [1, 10**9], "max_tokens": 1, "prompt_logprobs": 1}, "token ids in"),
    ({"prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 1, "model": "other"}, "not served here"),
])
def test_malformed_requests_get_a_4xx_with_a_reason(served, body, message):
    response = httpx.post(f"{served.url}/v1/completions", json=body)
    assert 400 <= response.status_code < 500
    assert message in response.json()["error"]["message"]


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
    """Forwards requests to the real server, misbehaving on the requests named in ``faults``.

    ``faults`` is consumed one entry per ``/v1/completions`` request: ``ok``, ``500``,
    ``slow`` (waits 2 s, longer than the client's timeout), ``truncate`` (announces the
    full length, sends half the body, closes), ``misalign`` (reports other token ids),
    ``short`` (drops the last position's log-probs), ``vllm`` (drops the rest masses, which
    vLLM does not send), ``bad_rest`` (a rest mass that does not add up with the top k to 1).
    """

    def __init__(self, target: str, faults: list[str]) -> None:
        self.faults = list(faults)
        self.seen = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                return None

            def _forward(self, method: str) -> httpx.Response:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
                return httpx.request(method, f"{target}{self.path}", content=body or None,
                                     headers={"Content-Type": "application/json"})

            def _send(self, status: int, data: bytes, length: int | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                response = self._forward("GET")
                self._send(response.status_code, response.content)

            def do_POST(self) -> None:  # noqa: N802
                if self.path != "/v1/completions":
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
                payload = response.json()
                if fault == "misalign":
                    payload["choices"][0]["prompt_token_ids"][1] += 1
                if fault == "short":
                    payload["choices"][0]["prompt_logprobs"].pop()
                if fault == "vllm":
                    for choice in payload["choices"]:
                        choice.pop(REST_MASS_FIELD, None)
                if fault == "bad_rest":
                    payload["choices"][0][REST_MASS_FIELD][1] = 0.5
                data = json.dumps(payload).encode()
                if fault == "truncate":
                    self._send(200, data[: len(data) // 2], length=len(data))
                    self.close_connection = True
                    return
                self._send(response.status_code, data)

        self.running = RunningServer(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        self.running.server.daemon_threads = True
        self.url = self.running.url


@pytest.mark.parametrize("faults", [["500", "500"], ["slow"], ["truncate"], ["500", "truncate", "slow"]])
def test_transient_faults_are_retried_and_the_answer_is_exact(served, teacher_model, tokenizer, faults):
    proxy = FaultProxy(served.url, faults)
    batch = batch_of(tokenizer, TEXTS)
    try:
        remote = client(proxy.url, timeout_s=1.0, sequences_per_request=len(TEXTS), max_concurrency=1)
        token = remote.get_token_logprobs(batch, len(tokenizer))
    finally:
        proxy.running.stop()
    assert remote.retries == len(faults)
    expected = LocalTeacher(teacher_model).get_token_logprobs(batch, len(tokenizer))
    for row, n in enumerate(batch["input_lengths"].tolist()):
        torch.testing.assert_close(token[row, :n], expected[row, :n], rtol=0, atol=1e-4)


@pytest.mark.parametrize("fault, message", [
    ("misalign", "scored other token ids than were sent"),
    ("short", "prompt_logprobs entries for"),
    ("500", "HTTP 500"),
    ("bad_rest", "do not add up to 1"),
])
def test_persistent_faults_stop_with_a_clear_error_and_nothing_reaches_the_loss(served, tokenizer, fault, message):
    proxy = FaultProxy(served.url, [fault] * 10)
    loss_fn = DistillationLossFn(kl_type="reverse", teacher_signal="topk", teacher_topk=K, vocab_size=len(tokenizer))
    batch = batch_of(tokenizer, TEXTS)
    reached_loss = []
    try:
        remote = client(proxy.url, max_retries=2, sequences_per_request=len(TEXTS))
        with pytest.raises(TeacherServiceError, match=re.escape(message)) as raised:
            reached_loss.append(remote.score(batch, loss_fn.teacher_request))
    finally:
        proxy.running.stop()
    assert reached_loss == []
    assert "after 3 attempts" in str(raised.value)
    assert proxy.seen == 3


def test_without_served_rest_masses_the_client_computes_them_from_the_top_k(served, teacher_model, tokenizer):
    """A vLLM server sends no rest mass: the client takes log(1 − Σ_k P) in float64 from the top k."""
    proxy = FaultProxy(served.url, ["vllm"] * 10)
    batch = batch_of(tokenizer, TEXTS)
    vocab = len(tokenizer)
    try:
        answer = client(proxy.url, sequences_per_request=len(TEXTS)).get_topk_logprobs(batch, K, 1.0, vocab)
    finally:
        proxy.running.stop()
    local = LocalTeacher(teacher_model).get_topk_logprobs(batch, K, 1.0, vocab)
    assert answer.rest_logprobs is not None and local.rest_logprobs is not None
    for row, n in enumerate(batch["input_lengths"].tolist()):
        received = answer.logprobs[row, : n - 1]
        torch.testing.assert_close(answer.rest_logprobs[row, : n - 1],
                                   rest_logprobs_from_topk(received).float(), rtol=0, atol=1e-6)
        torch.testing.assert_close(answer.rest_logprobs[row, : n - 1], local.rest_logprobs[row, : n - 1],
                                   rtol=0, atol=1e-4)


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
        name, [sys.executable, "-m", "opd", "serve-teacher", "--model", "tiny:teacher", "--port", str(port)],
        tmp_path, dict(os.environ), timeout=120,
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
        with pytest.raises(TeacherServiceError, match="after 3 attempts.*(Connect|Remote|Read)"):
            remote.get_token_logprobs(batch)
        # Restarted while the client is backing off: the same request then succeeds.
        slow_retry = client(f"http://127.0.0.1:{port}", max_retries=8, backoff_s=0.5)
        restarter = threading.Thread(target=lambda: restarted.append(start_server_process(tmp_path, port, "server2")))
        restarter.start()
        after = slow_retry.get_token_logprobs(batch)
        restarter.join()
        assert slow_retry.retries >= 1
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    finally:
        first.stop_if_running()
        for process in restarted:
            process.stop_if_running()


# ------------------------------------------------------------------ distillation, end to end


def test_distillation_with_the_served_teacher_equals_the_in_process_run(served, tmp_path):
    common = [
        f"data.train_path={TRAIN_DATA}", "data.val_path=null", "validation.val_at_start=false",
        "validation.val_at_end=false", "checkpointing.enabled=false", "logger.console=false",
        "training.batch_size=2", "training.micro_batch_size=null", "training.warmup_steps=0",
        "training.max_num_steps=3", "distillation.num_samples_per_prompt=1",
        "distillation.generate_strategy.max_length=8", "loss_fn.type=topk", f"loss_fn.k={K}",
    ]
    losses = {}
    for name, extra in (("local", []), ("remote", ["teacher.backend=remote", f"teacher.remote.url={served.url}",
                                                    "teacher.remote.backoff_s=0.01"])):
        config = load_config(MasterConfig, TINY_CONFIG, common + [f"output_dir={tmp_path / name}"] + extra)
        parts = setup(config)
        assert isinstance(parts.teacher_policy, RemoteTeacher if name == "remote" else LocalTeacher)
        distillation_train(**parts.as_arguments())
        records = [json.loads(line) for line in (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [record["train/loss"] for record in records if "train/loss" in record]
    assert len(losses["remote"]) == 3
    assert all(math.isfinite(value) for value in losses["remote"])
    assert losses["remote"] == pytest.approx(losses["local"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["teacher.backend=remote"], "needs teacher.remote.url"),
    (["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:1", "loss_fn.type=full_vocab"],
     "teacher.backend = remote cannot serve loss_fn.type = full_vocab"),
    (["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:1", "loss_fn.type=topk",
      "loss_fn.temperature=2.0"], "answers at temperature 1"),
    (["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:1", "loss_fn.type=topk",
      "validation.teacher_baseline=true"], "teacher_baseline"),
    (["teacher.backend=remote", "teacher.remote.url=http://127.0.0.1:1", "loss_fn.type=topk",
      "teacher.remote.api_key_env=OPD_TEST_UNSET_KEY"], "OPD_TEST_UNSET_KEY"),
    (["model.teacher_model_path=null"], "model.teacher_model_path is required"),
])
def test_teacher_config_mistakes_name_the_keys(tmp_path, overrides, message, monkeypatch):
    monkeypatch.delenv("OPD_TEST_UNSET_KEY", raising=False)
    # Cross-section mistakes stop the config's validation; an unset API key variable stops
    # the environment check that setup runs before anything is loaded.
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = load_config(MasterConfig, TINY_CONFIG,
                             [f"output_dir={tmp_path}", f"data.train_path={TRAIN_DATA}"] + overrides)
        check_environment(config)


def test_an_unreachable_teacher_server_fails_setup_before_the_student_loads(tmp_path):
    config = load_config(MasterConfig, TINY_CONFIG, [
        f"output_dir={tmp_path / 'run'}", f"data.train_path={TRAIN_DATA}", "data.val_path=null",
        "teacher.backend=remote", f"teacher.remote.url=http://127.0.0.1:{free_port()}", "loss_fn.type=topk",
        "teacher.remote.max_retries=1", "teacher.remote.backoff_s=0.01",
    ])
    with pytest.raises(TeacherServiceError, match="/v1/models gave no usable answer after 2 attempts"):
        setup(config)
