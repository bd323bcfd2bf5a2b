"""``opd serve-teacher``: a Hugging Face model as a teacher over HTTP (FastAPI on uvicorn).

Two protocols, one model:

* **vLLM's OpenAI-compatible subset**, so one client also works against ``vllm serve``: ``POST /v1/completions``
  with token-id prompts, ``"max_tokens": 1`` and ``"prompt_logprobs": k`` (per position ``"token id" → {"logprob",
  "rank", "decoded_token"}`` for the actual token and the top k, ``null`` at position 0; ``prompt_token_ids`` with
  ``"return_token_ids": true``), plus ``prompt_topk_rest_mass`` (the mass outside the top k; not in vLLM);
  ``POST /tokenize``; ``GET /v1/models``. Without ``prompt_logprobs`` the route generates as vLLM's does
  (``max_tokens``, ``n``, greedy at ``"temperature": 0`` else ``top_k`` or ``top_p``, ``seed``, stopping at the EOS
  ids and ``stop_token_ids``; ``token_ids`` up to and including the stop token; ``finish_reason`` ``stop`` or
  ``length``), for the validation baselines (:mod:`opd.teachers.served.remote_generation`).
* **opd's binary protocol** (:mod:`opd.teachers.served.wire`): ``POST /opd/v1/score`` answers top-k, token log-probs
  or final hidden states as flat tensors at the positions asked for; ``GET /opd/v1/info`` describes the output layer
  (shape, logit transform, checksum) a trainer applies to the hidden states.

Concurrent requests share forward passes (:mod:`opd.teachers.batching`). ``GET /health`` needs no token;
``GET /metrics`` is Prometheus text. The server binds 127.0.0.1 unless told otherwise (another interface needs a
bearer token or ``--allow-unauthenticated``), refuses bodies over ``--max-request-bytes`` unread (HTTP 413) or slower
than ``--body-timeout-s`` (HTTP 408), and on SIGTERM or Ctrl-C finishes the requests in flight before it exits.

FastAPI and uvicorn rather than Ray Serve: a teacher server often runs without the trainer's Ray cluster and must
start with one command; asyncio gives the batching loop and graceful shutdown with two small dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.rollout.hf_generation import HFGeneration
from opd.rollout.stop_tokens import stop_token_ids
from opd.teachers.batching import ScoringBatcher, ScoringJob
from opd.teachers.scoring import PositionLogprobs, PromptScorer
from opd.teachers.served import wire
from opd.teachers.served.openai_protocol import REST_MASS_FIELD

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

log = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 128
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
DEFAULT_MAX_BATCH_TOKENS = 16384
DEFAULT_BODY_TIMEOUT_S = 60.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class RequestError(Exception):
    """A request the server refuses; carries the HTTP status to answer with."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _is_int(value: Any) -> bool:
    # bool is an int subclass: True/False are not integers (token ids, counts) here.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(token) for token in value)


def _strategy(body: dict[str, Any], max_tokens: int) -> GenerateStrategyConfig:
    """A generation request's decoding as vLLM reads it: temperature 0 is greedy.

    ``top_k`` 0 or -1 and ``top_p`` 1 keep every token; one of the two may cut.
    """
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    top_p = body.get("top_p")
    top_p = 1.0 if top_p is None else top_p
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise RequestError(HTTPStatus.BAD_REQUEST, "'temperature' must be a number >= 0")
    if not _is_int(top_k) or top_k < 0 or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise RequestError(HTTPStatus.BAD_REQUEST, "'top_k' must be -1, 0 or positive and 'top_p' in (0, 1]")
    if temperature == 0:
        return GenerateStrategyConfig(max_length=max_tokens, decoding_method="greedy")
    if top_k > 0 and top_p < 1:
        raise RequestError(HTTPStatus.BAD_REQUEST, "this server samples with one of 'top_k' and 'top_p', not both")
    if top_k > 0:
        return GenerateStrategyConfig(
            max_length=max_tokens, decoding_method="top_k", temperature=temperature, top_k=top_k
        )
    return GenerateStrategyConfig(max_length=max_tokens, decoding_method="top_p", temperature=temperature, top_p=top_p)


class TeacherService:
    """The request logic, independent of HTTP; the limits are the command-line options of the same names."""

    def __init__(
        self,
        scorer: PromptScorer,
        tokenizer: Any,
        model_name: str,
        max_logprobs: int,
        max_model_len: int,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    ) -> None:
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.batcher = ScoringBatcher(scorer, max_batch_tokens)
        self.requests: Counter[str] = Counter()
        self._info: dict[str, Any] | None = None

    # ------------------------------------------------------------------ plain routes

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "max_model_len": self.max_model_len, "owned_by": "opd"}
            ],
        }

    def info(self) -> dict[str, Any]:
        """``/opd/v1/info``: the protocol, the model, and the output layer a trainer must hold."""
        if self._info is None:  # the head's checksum reads the whole layer once
            self._info = {
                "format": wire.FORMAT,
                "model": self.model_name,
                "max_model_len": self.max_model_len,
                "max_logprobs": self.max_logprobs,
                "signals": list(wire.SIGNALS),
                "head": self.scorer.head_info(),
            }
        return self._info

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'prompt' must be a string")
        tokens = self.tokenizer(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def metrics_text(self) -> str:
        """Prometheus' text exposition format."""
        stats = self.batcher.stats
        routes = sorted(self.requests.items())
        lines = ["# TYPE opd_teacher_requests_total counter"]
        lines += [f'opd_teacher_requests_total{{route="{route}"}} {count}' for route, count in routes]
        for name, kind, value in (
            ("opd_teacher_sequences_total", "counter", stats.sequences),
            ("opd_teacher_tokens_total", "counter", stats.tokens),
            ("opd_teacher_forward_passes_total", "counter", stats.forward_passes),
            ("opd_teacher_batched_requests_total", "counter", stats.jobs),
            ("opd_teacher_busy_seconds_total", "counter", f"{stats.busy_seconds:.6f}"),
            ("opd_teacher_tokens_per_second", "gauge", f"{stats.tokens_per_second():.3f}"),
            ("opd_teacher_queue_depth", "gauge", self.batcher.queue_depth),
        ):
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ checks

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(
                HTTPStatus.NOT_FOUND, f"model {model!r} is not served here (serving {self.model_name!r})"
            )

    def _check_k(self, k: Any, name: str, minimum: int) -> int:
        if not _is_int(k) or not minimum <= k <= self.max_logprobs:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"'{name}' must be an integer in [{minimum}, {self.max_logprobs}] "
                "(raise the server's --max-logprobs for more)",
            )
        return k

    def _check_sequences(self, sequences: list[list[int]]) -> None:
        vocab = self.scorer.vocab_size
        for index, ids in enumerate(sequences):
            if not ids or not all(0 <= token < vocab for token in ids):
                raise RequestError(
                    HTTPStatus.BAD_REQUEST, f"prompt {index}: expected a non-empty list of token ids in [0, {vocab})"
                )
            if len(ids) > self.max_model_len:
                raise RequestError(
                    HTTPStatus.BAD_REQUEST,
                    f"prompt {index} has {len(ids)} tokens, more than max_model_len {self.max_model_len}",
                )

    # ------------------------------------------------------------------ vLLM's completions

    def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if _is_token_list(prompt) and prompt:
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_token_list(item) for item in prompt):
            prompts = prompt
        else:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                "'prompt' must be a non-empty list of token ids or a list of such lists "
                "(this server scores token ids, not text)",
            )
        self._check_sequences(prompts)
        return prompts

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/v1/completions``: scores with ``prompt_logprobs`` (and ``max_tokens: 1``), else generates."""
        self._check_model(body)
        if body.get("prompt_logprobs") is None:
            return await self._generate(body)
        if body.get("max_tokens", 16) != 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, "this server only scores prompts: set 'max_tokens' to 1")
        k = self._check_k(body.get("prompt_logprobs"), "prompt_logprobs", 0)
        prompts = self._prompts(body)

        def finish(rows: list[torch.Tensor]) -> list[list[PositionLogprobs | None]]:
            return [self.scorer.prompt_logprobs(hidden, ids, k) for hidden, ids in zip(rows, prompts)]

        scored = await self.batcher.submit(ScoringJob(prompts, [0] * len(prompts), finish))
        choices = []
        for index, (ids, entries) in enumerate(zip(prompts, scored)):
            # No token is generated: the client reads only the prompt log-probs.
            choice: dict[str, Any] = {
                "index": index,
                "text": "",
                "finish_reason": "length",
                "logprobs": None,
                "prompt_logprobs": [self._position_json(entry) for entry in entries],
            }
            if k > 0:
                choice[REST_MASS_FIELD] = [None if entry is None else entry.rest_mass for entry in entries]
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = ids
                choice["token_ids"] = []
            choices.append(choice)
        return self._completion(choices, sum(len(ids) for ids in prompts), 0)

    async def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answers the prompts with new tokens (the module docstring lists the fields), on the model thread."""
        prompts = self._prompts(body)
        max_tokens = body.get("max_tokens", 16)
        if not _is_int(max_tokens) or not 1 <= max_tokens <= self.max_model_len:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'max_tokens' must be an integer in [1, {self.max_model_len}]")
        longest = max(len(prompt) for prompt in prompts)
        if longest + max_tokens > self.max_model_len:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"a prompt of {longest} tokens and 'max_tokens' {max_tokens} exceed max_model_len {self.max_model_len}",
            )
        samples = body.get("n", 1)
        if not _is_int(samples) or samples < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, "'n' must be a positive integer")
        if body.get("stop"):
            raise RequestError(HTTPStatus.BAD_REQUEST, "stop strings are not supported; send 'stop_token_ids'")
        extra_stops = body.get("stop_token_ids") or []
        if not _is_token_list(extra_stops):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'stop_token_ids' must be a list of token ids")
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'seed' must be an integer")
        strategy = _strategy(body, max_tokens)
        model = self.scorer.model
        stops = sorted({*stop_token_ids(self.tokenizer, model), *extra_stops})

        def generate() -> BatchedDataDict:
            if seed is not None:
                torch.manual_seed(seed)
            engine = HFGeneration(model, self.tokenizer, stop_ids=stops)
            engine.prepare_for_generation()
            try:
                return engine.generate(prompts, strategy, samples, return_logprobs=False)
            finally:
                engine.finish_generation()

        batch = await self.batcher.run_alone(generate)
        choices = []
        for row in range(batch.size):
            start, length = int(batch["prompt_lengths"][row]), int(batch["response_lengths"][row])
            response = batch["input_ids"][row, start : start + length].tolist()
            choice: dict[str, Any] = {
                "index": row,
                "text": self.tokenizer.decode(response, skip_special_tokens=True),
                "finish_reason": "length" if bool(batch["truncated"][row]) else "stop",
                "logprobs": None,  # the generated tokens' log-probs are not sent
            }
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = prompts[row // samples]
                choice["token_ids"] = response
            choices.append(choice)
        prompt_tokens = sum(len(prompt) for prompt in prompts) * samples
        return self._completion(choices, prompt_tokens, int(batch["response_lengths"].sum()))

    def _completion(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """vLLM's ``text_completion`` answer around ``choices``, with its token usage."""
        return {
            "id": f"cmpl-opd-{time.time_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _position_json(self, entry: PositionLogprobs | None) -> dict[str, dict[str, Any]] | None:
        if entry is None:
            return None
        ranked = zip(entry.top_ids, entry.top_logprobs, range(1, len(entry.top_ids) + 1))
        # The actual token comes last: where it is among the top k too, its own entry is the one kept.
        return {
            str(token): {"logprob": logprob, "rank": rank, "decoded_token": self.tokenizer.decode([token])}
            for token, logprob, rank in [*ranked, (entry.token_id, entry.logprob, entry.rank)]
        }

    # ------------------------------------------------------------------ opd's binary scoring

    async def score(self, body: dict[str, Any]) -> bytes:
        """``/opd/v1/score``: one signal at the positions asked for, as a tensor payload (see ``wire``)."""
        self._check_model(body)
        sequences = body.get("sequences")
        if not (isinstance(sequences, list) and sequences and all(_is_token_list(item) for item in sequences)):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'sequences' must be a non-empty list of lists of token ids")
        self._check_sequences(sequences)
        firsts = body.get("first_positions", [0] * len(sequences))
        if not (_is_token_list(firsts) and len(firsts) == len(sequences)) or any(
            not 0 <= first < len(ids) for first, ids in zip(firsts, sequences)
        ):
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                "'first_positions' must hold one integer per sequence, each in [0, the sequence's length)",
            )
        signal = body.get("signal")
        if signal not in wire.SIGNALS:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"'signal' must be one of {list(wire.SIGNALS)}, got {signal!r}")
        finish = self._finisher(signal, body, sequences, firsts)
        return await self.batcher.submit(ScoringJob(sequences, firsts, finish))

    def _finisher(
        self, signal: str, body: dict[str, Any], sequences: list[list[int]], firsts: list[int]
    ) -> Callable[[list[torch.Tensor]], bytes]:
        """Makes the answer body from the hidden rows (on the model thread) with the signal's ``wire.CODECS`` codec."""
        try:
            answer = wire.CODECS[signal].answerer(
                self.scorer, body, sequences, firsts, lambda k: self._check_k(k, "k", 1)
            )
        except wire.BadRequest as error:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(error)) from None

        def finish(rows: list[torch.Tensor]) -> bytes:
            return wire.build_answer(sequences, firsts, signal, answer(torch.cat(rows)))

        return finish


# ---------------------------------------------------------------------------- HTTP


async def _read_json(request: Request, max_request_bytes: int, body_timeout_s: float) -> dict[str, Any]:
    """The body as a JSON object, refusing what is too large, unannounced, too slow, or not JSON."""
    declared = request.headers.get("content-length")
    if declared is None:
        raise RequestError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
    if not declared.isdigit():
        raise RequestError(HTTPStatus.BAD_REQUEST, f"Content-Length {declared!r} is not a byte count")
    if int(declared) > max_request_bytes:
        raise RequestError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body of {declared} bytes exceeds the server's limit of {max_request_bytes}",
        )
    try:
        # A client that announces a body and sends it slowly (or never) does not hold the connection forever.
        raw = await asyncio.wait_for(request.body(), timeout=body_timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(
            HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive within {body_timeout_s:g} s"
        ) from None
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"the body is not UTF-8 text ({error})") from None
    except json.JSONDecodeError as error:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    return body


def _add_error_handlers(app: FastAPI) -> None:
    """Every error answers ``{"error": {"message", "type", "code"}}`` with its HTTP status."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def error(status: HTTPStatus, message: str, close: bool = False) -> JSONResponse:
        headers = {"Connection": "close"} if close else None
        payload = {"error": {"message": message, "type": status.phrase, "code": int(status)}}
        return JSONResponse(payload, status_code=int(status), headers=headers)

    @app.exception_handler(RequestError)
    async def refused(request: Request, problem: RequestError) -> JSONResponse:
        # A body refused unread (too large, too slow): close rather than drain the connection.
        unread = problem.status in (HTTPStatus.REQUEST_ENTITY_TOO_LARGE, HTTPStatus.REQUEST_TIMEOUT)
        return error(problem.status, str(problem), close=unread)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, problem: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(problem.status_code)
        return error(status, f"no route {request.url.path}" if status == HTTPStatus.NOT_FOUND else str(problem.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, problem: Exception) -> JSONResponse:
        log.error("request %s failed: %s: %s", request.url.path, type(problem).__name__, problem)
        return error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(problem).__name__}: {problem}")


def build_app(
    service: TeacherService,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> FastAPI:
    """The ASGI application serving ``service`` (its batcher runs while the app does)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.batcher.start()
        yield
        await service.batcher.stop()  # after uvicorn has let the requests in flight finish

    app = FastAPI(title="opd serve-teacher", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)

    def authorise(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")

    def counted(
        route: str, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            authorise(request)
            service.requests[route] += 1
            return await handler(request)

        return endpoint

    async def completions(request: Request) -> Response:
        return JSONResponse(await service.completions(await _read_json(request, max_request_bytes, body_timeout_s)))

    async def score(request: Request) -> Response:
        body = await service.score(await _read_json(request, max_request_bytes, body_timeout_s))
        return Response(body, media_type=wire.MEDIA_TYPE)

    async def tokenize(request: Request) -> Response:
        return JSONResponse(service.tokenize(await _read_json(request, max_request_bytes, body_timeout_s)))

    async def models(request: Request) -> Response:
        return JSONResponse(service.models())

    async def info(request: Request) -> Response:
        return JSONResponse(service.info())

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(service.metrics_text())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app.add_route("/health", health, methods=["GET"])
    for path, handler, methods in (
        ("/v1/completions", completions, ["POST"]),
        (wire.SCORE_PATH, score, ["POST"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/v1/models", models, ["GET"]),
        (wire.INFO_PATH, info, ["GET"]),
        ("/metrics", metrics, ["GET"]),
    ):
        app.add_route(path, counted(path, handler), methods=methods)
    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: any free port); OSError if the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app: FastAPI, graceful_timeout_s: int | None = None) -> Any:
    """A uvicorn server for ``app`` (run it with ``server.run(sockets=[...])``)."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=graceful_timeout_s, lifespan="on"
    )
    return uvicorn.Server(config)


# ---------------------------------------------------------------------------- command line


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in [0, 65535]")
    return port


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="opd serve-teacher", description="Serve a Hugging Face causal LM as a distillation teacher over HTTP."
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory of the teacher")
    parser.add_argument("--served-model-name", help="name reported by /v1/models (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free port)")
    parser.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the bearer token clients must send (default: none)",
    )
    for flag, default, meaning in (
        ("--max-logprobs", DEFAULT_MAX_LOGPROBS, "largest top-k accepted"),
        ("--max-request-bytes", DEFAULT_MAX_REQUEST_BYTES, "larger request bodies get HTTP 413"),
        ("--max-batch-tokens", DEFAULT_MAX_BATCH_TOKENS, "padded tokens per coalesced forward pass"),
    ):
        parser.add_argument(flag, type=_positive, default=default, help=f"{meaning} (default {default})")
    parser.add_argument("--max-model-len", type=_positive, help="longest sequence accepted (default: the model's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (ignored with --device-map)")
    parser.add_argument(
        "--device-map",
        help="spread a teacher too large for one device over all visible GPUs (auto, balanced, sequential)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help=f"a request body that takes longer to arrive gets HTTP 408 (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve an interface other than loopback without --api-key-env (anyone who reaches it can use the teacher)",
    )
    parser.add_argument(
        "--graceful-timeout-s",
        type=_positive,
        default=None,
        help="on SIGTERM, wait at most this long for requests in flight (default: until they finish)",
    )
    return parser.parse_args(argv)


def _fail(message: str) -> int:
    print(f"opd serve-teacher: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``opd serve-teacher``; serves until SIGTERM or Ctrl-C."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return _fail("the server needs FastAPI and uvicorn: pip install 'opd[serve]'")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            return _fail(f"--api-key-env {args.api_key_env} names an unset or empty variable")
    if api_key is None and args.host not in LOOPBACK_HOSTS:
        if not args.allow_unauthenticated:
            return _fail(
                f"--host {args.host} serves other machines, so set --api-key-env VAR (a bearer token); "
                "--allow-unauthenticated serves without one"
            )
        log.warning(
            "serving on %s without a bearer token (--allow-unauthenticated): anyone who can reach this machine "
            "can use the teacher",
            args.host,
        )
    from opd.models.config import ModelLoadingConfig
    from opd.models.loading import load_causal_lm, load_tokenizer, resolve_device
    from opd.utils.errors import OpdError

    try:
        sock = listening_socket(args.host, args.port)
    except OSError as error:
        return _fail(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}; choose another --port")
    try:
        device = resolve_device(args.device)
        tokenizer = load_tokenizer(args.model, False)
        model = load_causal_lm(args.model, getattr(torch, args.dtype), device, ModelLoadingConfig(), args.device_map)
        scorer = PromptScorer(model, len(tokenizer))
    except (OpdError, ValueError) as error:
        sock.close()
        return _fail(str(error))
    max_model_len = args.max_model_len or int(getattr(model.config, "max_position_embeddings", 32768))
    service = TeacherService(
        scorer, tokenizer, args.served_model_name or args.model, args.max_logprobs, max_model_len, args.max_batch_tokens
    )
    host, port = sock.getsockname()[:2]
    app = build_app(service, api_key, args.max_request_bytes, args.body_timeout_s)
    server = uvicorn_server(app, args.graceful_timeout_s)
    # uvicorn drains the requests in flight on SIGTERM / Ctrl-C, then re-raises the signal: exit 0 after the drain.
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, lambda number, frame: None)
    # One parseable line, flushed: scripts and tests wait for it.
    print(f"opd serve-teacher: serving {service.model_name} on http://{host}:{port}", flush=True)
    server.run(sockets=[sock])
    print("opd serve-teacher: stopped", flush=True)
    return 0
