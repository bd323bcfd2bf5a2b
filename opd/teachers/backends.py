"""Where a teacher runs: the values of ``teacher.backend`` and ``teachers.members[i].backend``, each registered once.

A :class:`TeacherBackend` answers everything the rest of opd asks about where a teacher runs: whether it is served
(over HTTP: no copy loaded, connected before the student loads), what it needs from the machine, which settings it
needs, which signals it cannot send, and how it builds the teacher, alone or as a member of several. Config,
validator and set-up go through :data:`TEACHER_BACKENDS`: a new backend is one subclass, its entry and its
:data:`TeacherBackendName` value, all in this file. Building goes through the run's :class:`TeacherLoader` (dtype,
device, tokenizer checks, the output layer a full-vocabulary loss needs).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from pydantic import Field

from opd.models.interfaces import TeacherInterface, TeacherRequest
from opd.teachers.local_teacher import LocalTeacher
from opd.teachers.served.remote_teacher import REQUEST_TIMEOUT_S, RemoteTeacher
from opd.utils.config import StrictConfig
from opd.utils.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class TeacherLoader(Protocol):
    """How the run loads and connects teachers (its dtype, device, tokenizer and loss decide the checks)."""

    def load(self, path: str) -> PreTrainedModel:
        """The frozen model at ``path`` (``student``: the student's starting point), checked against the run."""
        ...

    def connect(self, remote: RemoteTeacherConfig, model_path: str | None) -> RemoteTeacher:
        """The client of the server ``remote`` describes, checked; ``model_path`` holds its output layer."""
        ...


class TeacherBackend(ABC):
    """One value of a teacher's ``backend``; ``teacher_class.unsupported_reason`` lists the signals it cannot send."""

    name: ClassVar[str]
    served: ClassVar[bool]
    teacher_class: ClassVar[type[TeacherInterface]]

    def check_environment(self, source: TeacherSourceConfig, key: str) -> None:  # noqa: B027 - most need nothing
        """Fails at once, naming the setting under ``key``, when this machine cannot reach the teacher."""

    def problem(self, source: TeacherSourceConfig, model_path: str | None, key: str) -> str | None:
        """What the settings under ``key`` (``teacher`` or ``teachers.members[i]``) lack for this backend, or None."""
        return None

    def unsupported_reason(self, request: TeacherRequest) -> str | None:
        """Why a teacher of this backend cannot answer ``request`` (checked before anything is built), or None."""
        return self.teacher_class.unsupported_reason(request)

    @abstractmethod
    def build(self, loader: TeacherLoader, source: TeacherSourceConfig, model_path: str | None) -> TeacherInterface:
        """The teacher ``source`` describes, alone or as a member of several.

        ``model_path``: its model (``student``: the student's starting point); for a served teacher, where its output
        layer is read (None: the run's default).
        """


class LocalBackend(TeacherBackend):
    """``local``: the teacher's model in this process (or in its cluster's workers), frozen."""

    name = "local"
    served = False
    teacher_class = LocalTeacher

    def build(self, loader: TeacherLoader, source: TeacherSourceConfig, model_path: str | None) -> TeacherInterface:
        """Loads ``model_path`` (required: the validator names the missing key)."""
        assert model_path is not None, "a local teacher needs its model path (checked with the config)"
        return LocalTeacher(loader.load(model_path), share_prompt_forward=source.share_prompt_forward)


class RemoteBackend(TeacherBackend):
    """``remote``: ``opd serve-teacher`` or ``vllm serve`` behind HTTP (settings in ``remote``)."""

    name = "remote"
    served = True
    teacher_class = RemoteTeacher

    def check_environment(self, source: TeacherSourceConfig, key: str) -> None:
        """The environment variable ``remote.api_key_env`` names must hold the API key."""
        remote = source.remote
        if remote.api_key_env and not os.environ.get(remote.api_key_env):
            raise ConfigError(
                f"{key}.remote.api_key_env names the environment variable {remote.api_key_env}, which is unset or empty"
            )

    def problem(self, source: TeacherSourceConfig, model_path: str | None, key: str) -> str | None:
        """The server's URL is required."""
        if source.remote.url is None:
            return f"{key}.backend = remote needs {key}.remote.url (e.g. http://127.0.0.1:8000)"
        return None

    def build(self, loader: TeacherLoader, source: TeacherSourceConfig, model_path: str | None) -> TeacherInterface:
        """Connects to the server (its tokenizer and, for a full-vocabulary loss, its output layer checked)."""
        return loader.connect(source.remote, model_path)


TEACHER_BACKENDS: dict[str, TeacherBackend] = {backend.name: backend for backend in (LocalBackend(), RemoteBackend())}
"""Every teacher backend, by its ``backend`` value."""


def model_in_process(teacher: TeacherInterface | None) -> PreTrainedModel | None:
    """The teacher's model when it runs in this process (stop tokens, baselines, head checks), else None."""
    return teacher.model if isinstance(teacher, LocalTeacher) else None


class RemoteTeacherConfig(StrictConfig):
    """Where the served teacher is and how to talk to it (``teacher.remote``)."""

    url: str | None = Field(None, description="base URL of vLLM's OpenAI-compatible server or opd serve-teacher")
    model: str | None = Field(None, description="served model name; null = the first model the server lists")
    api_key_env: str | None = Field(None, description="environment variable holding the bearer token, if any")
    max_concurrency: int = Field(4, ge=1, description="requests in flight at once")
    sequences_per_request: int = Field(8, ge=1, description="sequences scored per request")
    timeout_s: float = Field(REQUEST_TIMEOUT_S, gt=0, description="per-request timeout in seconds")
    max_retries: int = Field(4, ge=0, description="further attempts after a failed request (exponential backoff)")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry, doubled for each next one")
    protocol: Literal["auto", "opd", "openai"] = Field(
        "auto",
        description="opd = opd serve-teacher's binary protocol (hidden states, top-k, token log-probs); "
        "openai = vLLM's JSON prompt_logprobs (top-k, token log-probs); auto = opd where the server offers it",
    )
    hidden_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="precision of the hidden states on the wire (full-vocabulary losses); auto = the server's"
    )


TeacherBackendName = Literal["local", "remote"]
"""The values of a teacher's ``backend``: one per entry of :data:`TEACHER_BACKENDS`."""


class TeacherSourceConfig(StrictConfig):
    """Where one teacher runs: in the run (``local``: its model is loaded by the trainer or its cluster's
    workers) or behind HTTP (``remote``: ``opd serve-teacher`` or ``vllm serve``)."""

    backend: TeacherBackendName = Field("local", description="local = the model in process")
    remote: RemoteTeacherConfig = Field(default_factory=RemoteTeacherConfig, description="used when backend = remote")
    share_prompt_forward: bool = Field(
        True,
        description="backend = local: rows of a micro-batch that begin with the same prompt (the samples of one "
        "prompt) share one teacher forward over it; the scores equal one pass's (models whose layers are not all "
        "full attention always score in one pass)",
    )

    @property
    def teacher_backend(self) -> TeacherBackend:
        """The backend ``backend`` names (:data:`TEACHER_BACKENDS`)."""
        return TEACHER_BACKENDS[self.backend]

    @property
    def served(self) -> bool:
        """The teacher answers over HTTP; the run loads no copy of it."""
        return self.teacher_backend.served

    def build(self, loader: TeacherLoader, model_path: str | None) -> TeacherInterface:
        """These settings' teacher, built by its backend; ``model_path`` as in :meth:`TeacherBackend.build`."""
        return self.teacher_backend.build(loader, self, model_path)
