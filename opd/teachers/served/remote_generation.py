"""A served teacher's own answers to prompts: the validation baselines' engine for ``teacher.backend: remote``.

:class:`RemoteGeneration` asks ``/v1/completions`` (``opd serve-teacher`` and vLLM answer it whatever
``teacher.remote.protocol`` says) with token-id prompts, vLLM's decoding fields and the run's stop tokens as
``stop_token_ids``. Response ids come back as ``token_ids`` (vLLM 0.10.2 and later, ``opd serve-teacher``), or from
an older vLLM as ``token_id:<id>`` strings in ``logprobs.tokens``; ``finish_reason`` ``length`` means truncated.
No sampler log-probs (validation does not read them). Failures are retried as the scoring client retries them
(:class:`~opd.teachers.served.remote_teacher.ServedClient`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opd.data.batched_data_dict import BatchedDataDict
from opd.models.decoding import GenerateStrategyConfig
from opd.models.interfaces import GenerationInterface
from opd.rollout.rollout_batch import build_rollout_batch
from opd.rollout.stop_tokens import stop_token_ids
from opd.teachers.backends import RemoteTeacherConfig
from opd.teachers.served.remote_teacher import REQUEST_TIMEOUT_S, ServedClient, TeacherServiceError

COMPLETIONS_PATH = "/v1/completions"
TOKEN_ID_PREFIX = "token_id:"
_SEED_RANGE = 2**31 - 1


_SAMPLING_FIELDS: dict[str, Callable[[GenerateStrategyConfig], dict[str, Any]]] = {
    "greedy": lambda strategy: {"temperature": 0.0},
    "top_k": lambda strategy: {"temperature": strategy.temperature, "top_k": strategy.top_k, "top_p": 1.0},
    "top_p": lambda strategy: {"temperature": strategy.temperature, "top_k": -1, "top_p": strategy.top_p},
}
"""vLLM's completion fields of each decoding method (``top_k: -1`` and ``top_p: 1`` keep every token)."""


def sampling_fields(strategy: GenerateStrategyConfig) -> dict[str, Any]:
    """``strategy`` as vLLM's completion fields."""
    return _SAMPLING_FIELDS[strategy.decoding_method](strategy)


def response_ids(choice: dict[str, Any]) -> list[int]:
    """A completion choice's response token ids: ``token_ids``, else ``logprobs.tokens`` as ``token_id:<id>``.

    Raises:
        TeacherServiceError: the choice carries neither.
    """
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(token, int) for token in ids):
        return ids
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if isinstance(tokens, list) and all(
        isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX) for token in tokens
    ):
        return [int(token[len(TOKEN_ID_PREFIX) :]) for token in tokens]
    raise TeacherServiceError(
        "the teacher server sent no token ids for a completion (neither 'token_ids' nor 'token_id:' logprobs "
        "tokens); serve with opd serve-teacher or vLLM 0.10.2 or later"
    )


class RemoteGeneration(ServedClient, GenerationInterface):
    """``GenerationInterface`` over a served teacher's ``/v1/completions``; ``stop_ids`` add to the server's EOS ids."""

    def __init__(
        self,
        url: str,
        model: str | None,
        api_key: str | None,
        stop_ids: Sequence[int],
        pad_token_id: int,
        timeout_s: float = REQUEST_TIMEOUT_S,
        max_retries: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        super().__init__(url, api_key, timeout_s, max_retries, backoff_s)
        self.model = model
        self.stop_ids = list(stop_ids)
        self.pad_token_id = pad_token_id

    @classmethod
    def from_config(cls, remote: RemoteTeacherConfig, tokenizer: Any) -> RemoteGeneration:
        """The engine of the server ``remote`` names, stopping at ``tokenizer``'s EOS (and the server's own)."""
        if remote.url is None:
            raise ValueError("a served teacher needs its remote.url")
        api_key = os.environ.get(remote.api_key_env) if remote.api_key_env else None
        return cls(
            remote.url,
            remote.model,
            api_key,
            stop_token_ids(tokenizer),
            tokenizer.pad_token_id,
            remote.timeout_s,
            remote.max_retries,
            remote.backoff_s,
        )

    def prepare_for_generation(self) -> None:
        """Nothing to switch on: the server holds the model."""

    def finish_generation(self) -> None:
        """Nothing to release."""

    def generate(
        self,
        prompts: list[list[int]],
        strategy: GenerateStrategyConfig,
        num_samples: int = 1,
        return_logprobs: bool = True,
    ) -> BatchedDataDict:
        """The server's answers to ``prompts``, in one request; the seed sent is drawn from torch's generator.

        Raises:
            ValueError: ``return_logprobs`` (no sampler log-probs are sent).
            TeacherServiceError: no usable answer after the retries, another number of choices, or no token ids.
        """
        if return_logprobs:
            raise ValueError("a served teacher's answers carry no sampler log-probs; ask with return_logprobs=False")
        body = {
            "model": self._model_name(),
            "prompt": prompts,
            "max_tokens": strategy.max_length,
            "n": num_samples,
            "seed": int(torch.randint(_SEED_RANGE, (1,))),
            "stop_token_ids": self.stop_ids,
            "return_token_ids": True,
            # An older vLLM without return_token_ids names each generated token by its id here.
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **sampling_fields(strategy),
        }
        answer = self._request("POST", COMPLETIONS_PATH, body)
        choices = sorted(answer.get("choices") or [], key=lambda choice: choice.get("index", 0))
        expanded = [prompt for prompt in prompts for _ in range(num_samples)]
        if len(choices) != len(expanded):
            raise TeacherServiceError(
                f"teacher server {self.url}{COMPLETIONS_PATH} answered {len(choices)} completions for "
                f"{len(expanded)} asked"
            )
        responses = [response_ids(choice) for choice in choices]
        truncated = [choice.get("finish_reason") == "length" for choice in choices]
        return build_rollout_batch(expanded, responses, None, truncated, self.pad_token_id)

    def _model_name(self) -> str:
        """The configured model, else the first one the server lists (asked once)."""
        if self.model is None:
            self.model = str(self._served_models()[0])
        return self.model
