"""``opd serve-teacher``: a Hugging Face model as a teacher over HTTP.

It speaks the subset of vLLM's OpenAI-compatible API that opd's remote teacher
(:mod:`opd.models.teacher.remote_teacher`) uses, so the same client works against
``vllm serve`` on GPUs and against this server wherever vLLM is not installed (and in
tests):

* ``POST /v1/completions`` with token-id prompts (``"prompt": [ids]`` or a list of
  them), ``"max_tokens": 1``, ``"prompt_logprobs": k`` and optionally
  ``"return_token_ids": true``. Each choice carries ``prompt_logprobs`` — ``null`` at
  position 0, then per position a map ``"token id" → {"logprob", "rank",
  "decoded_token"}`` holding the actual token and the ``k`` most likely ones — and, when
  asked, ``prompt_token_ids``. No token is generated (the completion is empty).
  One field goes beyond vLLM: with ``k > 0``, ``prompt_topk_rest_mass`` (``null`` at
  position 0, then per position 1 − Σ of the ``k`` top tokens' probabilities, summed by
  the server over the other tokens so that it does not cancel; a client that does not
  know the field ignores it, and opd's client computes the mass itself when it is absent).
* ``POST /tokenize`` (``{"prompt": text}`` → ``{"tokens": [...], "count": n}``), which
  the client uses to check that both sides tokenize alike.
* ``GET /v1/models`` and ``GET /health``.

It binds 127.0.0.1 unless told otherwise, checks ``Authorization: Bearer <key>`` when
started with an API key, and refuses bodies over ``--max-request-bytes`` (HTTP 413)
before reading them. Requests are served by threads; the model scores one request at a
time.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opd.models.teacher.scoring import PromptScorer

log = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 128
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
REST_MASS_FIELD = "prompt_topk_rest_mass"
"""The choice field with each position's probability mass outside its top k (not in vLLM's API)."""


class RequestError(Exception):
    """A request the server refuses; carries the HTTP status to answer with."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class TeacherService:
    """The request logic, independent of HTTP (tested directly and through the server).

    Args:
        scorer: computes the prompt log-probs.
        tokenizer: the teacher's tokenizer (``/tokenize`` and ``decoded_token``).
        model_name: the name ``/v1/models`` reports and requests may name.
        max_logprobs: the largest ``prompt_logprobs`` accepted (vLLM's ``--max-logprobs``).
        max_model_len: the longest sequence accepted, in tokens.
    """

    def __init__(
        self, scorer: PromptScorer, tokenizer: Any, model_name: str, max_logprobs: int, max_model_len: int
    ) -> None:
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self._model_lock = threading.Lock()

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "max_model_len": self.max_model_len, "owned_by": "opd"}
            ],
        }

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "'prompt' must be a string")
        tokens = self.tokenizer(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(item, list) for item in prompt):
            prompts = prompt
        else:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                "'prompt' must be a non-empty list of token ids or a list of such lists "
                "(this server scores token ids, not text)",
            )
        vocab = self.scorer.vocab_size
        for index, ids in enumerate(prompts):
            if not ids or not all(isinstance(token, int) and 0 <= token < vocab for token in ids):
                raise RequestError(
                    HTTPStatus.BAD_REQUEST, f"prompt {index}: expected a non-empty list of token ids in [0, {vocab})"
                )
            if len(ids) > self.max_model_len:
                raise RequestError(
                    HTTPStatus.BAD_REQUEST,
                    f"prompt {index} has {len(ids)} tokens, more than max_model_len {self.max_model_len}",
                )
        return prompts

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(
                HTTPStatus.NOT_FOUND, f"model {model!r} is not served here (serving {self.model_name!r})"
            )
        if body.get("max_tokens", 16) != 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, "this server only scores prompts: set 'max_tokens' to 1")
        k = body.get("prompt_logprobs")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.max_logprobs:
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"'prompt_logprobs' must be an integer in [0, {self.max_logprobs}] "
                "(raise the server's --max-logprobs for more)",
            )
        prompts = self._prompts(body)
        with self._model_lock:
            scored = self.scorer.score(prompts, k)
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
        tokens = sum(len(ids) for ids in prompts)
        return {
            "id": f"cmpl-opd-{time.time_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        }

    def _position_json(self, entry: Any) -> dict[str, dict[str, Any]] | None:
        if entry is None:
            return None
        answer = {
            str(token): {"logprob": logprob, "rank": rank + 1, "decoded_token": self.tokenizer.decode([token])}
            for rank, (token, logprob) in enumerate(zip(entry.top_ids, entry.top_logprobs))
        }
        answer[str(entry.token_id)] = {
            "logprob": entry.logprob,
            "rank": entry.rank,
            "decoded_token": self.tokenizer.decode([entry.token_id]),
        }
        return answer


def make_handler(service: TeacherService, api_key: str | None, max_request_bytes: int) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to ``service``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "opd-serve-teacher"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: HTTPStatus, message: str) -> None:
            self._reply(status, {"error": {"message": message, "type": status.phrase, "code": int(status)}})

        def _authorised(self) -> bool:
            if api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return True
            self._error(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            return False

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok"})
            elif self.path == "/v1/models":
                if self._authorised():
                    self._reply(HTTPStatus.OK, service.models())
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")

        def do_POST(self) -> None:
            if not self._authorised():
                return
            routes = {"/v1/completions": service.completions, "/tokenize": service.tokenize}
            if self.path not in routes:
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._error(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
                return
            if length > max_request_bytes:
                # Refused before reading: the connection is closed rather than drained.
                self.close_connection = True
                self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request body of {length} bytes exceeds the server's limit of {max_request_bytes}",
                )
                return
            try:
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise RequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
                self._reply(HTTPStatus.OK, routes[self.path](body))
            except json.JSONDecodeError as error:
                self._error(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {error}")
            except RequestError as error:
                self._error(error.status, str(error))
            except Exception as error:  # a bug or an out-of-memory: report it, keep serving
                log.exception("request failed")
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")

    return Handler


def build_server(
    service: TeacherService,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> ThreadingHTTPServer:
    """A threading HTTP server for ``service`` (not yet serving; call ``serve_forever``)."""
    server = ThreadingHTTPServer((host, port), make_handler(service, api_key, max_request_bytes))
    server.daemon_threads = True
    return server


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="opd serve-teacher", description="Serve a Hugging Face causal LM's prompt log-probs over HTTP."
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory of the teacher")
    parser.add_argument("--served-model-name", help="name reported by /v1/models (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="environment variable holding the bearer token clients must send (default: none)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        help=f"largest prompt_logprobs accepted (default {DEFAULT_MAX_LOGPROBS})",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies get HTTP 413 (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    parser.add_argument("--max-model-len", type=int, help="longest sequence accepted (default: the model's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``opd serve-teacher``; serves until interrupted."""
    import torch

    from opd.models.loading import load_causal_lm, load_tokenizer, resolve_device

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(
                f"opd serve-teacher: error: --api-key-env {args.api_key_env} names an unset or empty variable",
                file=sys.stderr,
            )
            return 2
    from opd.models.config import ModelLoadingConfig
    from opd.utils.errors import OpdError

    try:
        device = resolve_device(args.device)
        tokenizer = load_tokenizer(args.model, False)
        model = load_causal_lm(args.model, getattr(torch, args.dtype), device, ModelLoadingConfig())
    except OpdError as error:
        print(f"opd serve-teacher: error: {error}", file=sys.stderr)
        return 2
    max_model_len = args.max_model_len or int(getattr(model.config, "max_position_embeddings", 32768))
    service = TeacherService(
        PromptScorer(model, len(tokenizer)),
        tokenizer,
        args.served_model_name or args.model,
        args.max_logprobs,
        max_model_len,
    )
    server = build_server(service, args.host, args.port, api_key, args.max_request_bytes)
    host, port = server.server_address[:2]
    host = host.decode() if isinstance(host, bytes) else host
    # One parseable line, flushed: scripts and tests wait for it.
    print(f"opd serve-teacher: serving {service.model_name} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log.info("interrupted; shutting down")
    finally:
        server.server_close()
    return 0
