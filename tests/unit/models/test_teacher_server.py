"""``opd serve-teacher`` as a server: batching, metrics, refusals, shutdown, over real HTTP on 127.0.0.1.

* concurrent requests are coalesced into shared forward passes (within the token budget)
  and get the same answers as when sent one by one;
* ``/health`` and ``/metrics`` (requests, tokens, forward passes, queue depth);
* bodies that are not UTF-8, nested too deeply, announce a negative length or none, and
  boolean token ids get a 4xx with a reason, and never hang the connection;
* ``/v1/completions`` without ``prompt_logprobs`` generates: greedy answers are the
  in-process engine's, a seed repeats a sampled answer, bad sampling fields get a 400;
* a server process: ``--device-map auto`` loads a model directory, SIGTERM lets the
  request in flight finish before the process exits, a port in use is a one-line error.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import httpx
import pytest
import torch
from opd_test_helpers import REPO_ROOT, BackgroundProcess, RunningServer

from opd.models.tiny import build_tiny_model, build_tiny_tokenizer
from opd.teachers.scoring import PromptScorer
from opd.teachers.served import wire
from opd.teachers.served.server import TeacherService

DEMO_TEACHER = REPO_ROOT / "examples" / "demo" / "models" / "teacher"


class GatedScorer(PromptScorer):
    """A scorer whose first forward pass waits for :attr:`gate`, so that requests queue behind it."""

    def __init__(self, model, vocab_size: int) -> None:
        super().__init__(model, vocab_size)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.passes: list[tuple[int, int]] = []
        """(sequences, longest) of each forward pass."""

    def hidden_rows(self, sequences, first_positions):
        if not self.passes:
            self.entered.set()
            self.gate.wait(timeout=60)
        self.passes.append((len(sequences), max(map(len, sequences))))
        return super().hidden_rows(sequences, first_positions)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def teacher_model():
    return build_tiny_model("teacher").eval()


def sequences_for(index: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(index)
    return [torch.randint(3, 250, (int(length),), generator=generator).tolist() for length in (9 + index, 4)]


def score(url: str, sequences: list[list[int]], signal_: str = "topk") -> bytes:
    body = {"sequences": sequences, "first_positions": [1] * len(sequences), "signal": signal_, "k": 4}
    response = httpx.post(f"{url}{wire.SCORE_PATH}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.content


@pytest.mark.parametrize("budget, passes_after_the_first", [(4096, 1), (60, 3)])
def test_concurrent_requests_share_forward_passes_and_get_the_same_answers(
    teacher_model, tokenizer, budget, passes_after_the_first
):
    scorer = GatedScorer(teacher_model, len(tokenizer))
    running = RunningServer(TeacherService(scorer, tokenizer, "tiny", 16, 512, max_batch_tokens=budget))
    answers: dict[int, bytes] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, score(running.url, sequences_for(i))))
                   for i in range(6)]
        threads[0].start()
        assert scorer.entered.wait(timeout=60)  # the first request is held in its forward pass
        for thread in threads[1:]:
            thread.start()
        deadline = time.monotonic() + 60
        while running.service.batcher.queue_depth < 5:
            assert time.monotonic() < deadline, "the requests did not queue"
            time.sleep(0.01)
        scorer.gate.set()
        for thread in threads:
            thread.join(timeout=60)
        passes = list(scorer.passes)
        # Sent one at a time, each request is answered alone: the same answer (to the
        # rounding of a differently padded batch).
        for index in range(6):
            sequences = sequences_for(index)
            together, alone = (wire.decode(body, sequences, [1, 1], "topk", 4)
                               for body in (answers[index], score(running.url, sequences)))
            assert torch.equal(together["topk_ids"], alone["topk_ids"])
            # float32 rounding: a batch of another shape may take other kernels (AVX-512 ones do).
            torch.testing.assert_close(together["topk_logprobs"], alone["topk_logprobs"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(together["rest_logprobs"], alone["rest_logprobs"], rtol=1e-5, atol=1e-5)
    finally:
        running.stop()
    assert sum(count for count, _ in passes) == 12  # every sequence scored once
    assert len(passes) == 1 + passes_after_the_first
    # Within the budget: padded tokens (sequences × longest) per pass.
    assert all(count * longest <= budget for count, longest in passes)


def test_health_and_metrics(teacher_model, tokenizer):
    running = RunningServer(
        TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny", 16, 512), api_key="s3cret"
    )
    headers = {"Authorization": "Bearer s3cret"}
    try:
        assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}  # no token needed
        assert httpx.get(f"{running.url}/metrics").status_code == 401
        body = {"sequences": [[5, 6, 7, 8], [9, 10]], "signal": "token_logprobs"}
        for _ in range(2):
            assert httpx.post(f"{running.url}{wire.SCORE_PATH}", json=body, headers=headers).status_code == 200
        text = httpx.get(f"{running.url}/metrics", headers=headers).text
    finally:
        running.stop()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values['opd_teacher_requests_total{route="/opd/v1/score"}'] == 2
    assert values["opd_teacher_sequences_total"] == 4
    assert values["opd_teacher_tokens_total"] == 12
    assert values["opd_teacher_forward_passes_total"] == 2
    assert values["opd_teacher_queue_depth"] == 0
    assert values["opd_teacher_tokens_per_second"] > 0


def raw_exchange(port: int, request: bytes) -> bytes:
    """Sends raw bytes, returns whatever the server answers before closing (bounded by a timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request)
        connection.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("body, message", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"sequences": [[true, false, 1]], "signal": "topk", "k": 2}', "lists of token ids"),
    (b'{"sequences": [[1, 2]], "signal": "logits"}', "'signal' must be one of"),
    (b'{"sequences": [[1, 2]], "first_positions": [2], "signal": "token_logprobs"}', "first_positions"),
    (b'{"sequences": [[1, 2]], "signal": "hidden_states", "hidden_dtype": "int8"}', "hidden_dtype"),
])
def test_malformed_bodies_get_a_4xx_with_a_reason(teacher_model, tokenizer, body, message):
    running = RunningServer(TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny", 16, 512))
    try:
        response = httpx.post(f"{running.url}{wire.SCORE_PATH}", content=body,
                              headers={"Content-Type": "application/json"})
        after = httpx.post(f"{running.url}{wire.SCORE_PATH}", json={"sequences": [[5, 6, 7]], "signal": "topk", "k": 2})
    finally:
        running.stop()
    assert 400 <= response.status_code < 500
    assert message in response.json()["error"]["message"]
    assert after.status_code == 200  # the next good request is answered


def test_completions_without_prompt_logprobs_generate_as_the_engine_in_process(teacher_model, tokenizer):
    from opd.models.decoding import GenerateStrategyConfig
    from opd.rollout.hf_generation import HFGeneration

    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 3?", "hi")]
    running = RunningServer(TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny", 16, 64))

    def complete(**fields):
        return httpx.post(f"{running.url}/v1/completions", json={"prompt": prompts, "return_token_ids": True, **fields})

    try:
        greedy = complete(max_tokens=6, temperature=0, n=2).json()["choices"]
        sampled = [complete(max_tokens=6, temperature=1.0, top_k=5, seed=3).json()["choices"] for _ in range(2)]
        refused = {message: complete(**fields) for fields, message in [
            ({"max_tokens": 0}, "'max_tokens' must be an integer"),
            ({"max_tokens": 60}, "exceed max_model_len 64"),
            ({"temperature": 1.0, "top_k": 5, "top_p": 0.5}, "not both"),
            ({"stop": ["\n"]}, "send 'stop_token_ids'"),
        ]}
    finally:
        running.stop()
    batch = HFGeneration(teacher_model, tokenizer).generate(
        prompts, GenerateStrategyConfig(max_length=6, decoding_method="greedy"), 2, return_logprobs=False)
    for row, choice in enumerate(greedy):
        start, length = int(batch["prompt_lengths"][row]), int(batch["response_lengths"][row])
        assert choice["index"] == row and choice["prompt_token_ids"] == prompts[row // 2]
        assert choice["token_ids"] == batch["input_ids"][row, start : start + length].tolist()
        assert choice["finish_reason"] == ("length" if batch["truncated"][row] else "stop")
    assert sampled[0] == sampled[1] and len(sampled[0]) == 2
    for message, response in refused.items():
        assert response.status_code == 400 and message in response.json()["error"]["message"]


@pytest.mark.parametrize("length_header, status", [(b"Content-Length: -5\r\n", b"400"), (b"", b"411")])
def test_bad_or_missing_content_length_is_answered_not_hung(teacher_model, tokenizer, length_header, status):
    running = RunningServer(TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny", 16, 512))
    try:
        answer = raw_exchange(running.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + length_header + b"\r\n")
    finally:
        running.stop()
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == status


def test_a_body_that_does_not_arrive_gets_408_and_the_server_keeps_answering(teacher_model, tokenizer):
    service = TeacherService(PromptScorer(teacher_model, len(tokenizer)), tokenizer, "tiny", 16, 512)
    running = RunningServer(service, body_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", running.port), timeout=10) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            began = time.monotonic()
            answer = connection.recv(65536)  # the rest of the body never comes
            waited = time.monotonic() - began
            while chunk := connection.recv(65536):  # the body may follow the headers separately
                answer += chunk
        after = httpx.get(f"{running.url}/v1/models")
    finally:
        running.stop()
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"408"
    assert b"did not arrive within 0.5 s" in answer
    assert 0.4 < waited < 5
    assert after.status_code == 200


def test_serving_other_machines_needs_a_token_or_an_explicit_flag(capsys):
    from opd.teachers.served.server import main as serve_main

    assert serve_main(["--model", "tiny:teacher", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "set --api-key-env VAR" in capsys.readouterr().err


# ------------------------------------------------------------------ a real server process


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_sigterm_finishes_the_request_in_flight_and_a_port_in_use_is_one_line(tmp_path):
    port = free_port()
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = BackgroundProcess(
        "server", [sys.executable, "-m", "opd", "serve-teacher", "--model", str(DEMO_TEACHER), "--device-map", "auto",
                   "--port", str(port), "--max-batch-tokens", "1000000"],
        tmp_path, environment, timeout=120,
    )
    try:
        server.wait_until(lambda: "serving" in server.stdout, "the server to start")
        url = f"http://127.0.0.1:{port}"
        # A second server on the same port: one line, exit 2, no traceback.
        clash = BackgroundProcess("clash", [sys.executable, "-m", "opd", "serve-teacher", "--model", "tiny:teacher",
                                            "--port", str(port)], tmp_path, environment, timeout=120)
        assert clash.wait() == 2
        assert "cannot listen on 127.0.0.1" in clash.stderr and "Traceback" not in clash.stderr
        # A request long enough to be in flight when SIGTERM arrives.
        generator = torch.Generator().manual_seed(0)
        sequences = [torch.randint(3, 400, (400,), generator=generator).tolist() for _ in range(48)]
        result: dict[str, httpx.Response] = {}
        answered_at: list[float] = []

        def send() -> None:
            result["answer"] = httpx.post(f"{url}{wire.SCORE_PATH}", json={"sequences": sequences,
                                                                           "signal": "hidden_states"}, timeout=120)
            answered_at.append(time.monotonic())

        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 60
        while 'route="/opd/v1/score"} 1' not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.send(signal.SIGTERM)
        terminated_at = time.monotonic()
        sender.join(timeout=120)
        assert server.wait() == 0
    finally:
        server.stop_if_running()
    answer = result["answer"]
    assert answer.status_code == 200
    assert answered_at[0] > terminated_at  # it was in flight when the signal came
    hidden = wire.decode(answer.content, sequences, [0] * len(sequences), "hidden_states", 0, (128, torch.float32))
    assert hidden["hidden_states"].shape == (48 * 399, 128)
    assert "stopped" in server.stdout
