"""User-facing error types, and the one-line quoting of a library's error inside their messages.

Everything a user can get wrong raises an :class:`OpdError`, which the CLI prints as one line, exiting with
status 2 (no traceback). Bugs in opd itself raise ordinary exceptions.
"""


class OpdError(Exception):
    """Base class for errors caused by user input; the message is shown as is."""


class ConfigError(OpdError):
    """A configuration key is unknown, has the wrong type, or is out of range."""


class DataError(OpdError):
    """A dataset file, line or field is missing or malformed."""


class ModelCompatibilityError(OpdError):
    """Teacher and student cannot be paired (e.g. different tokenizers)."""


class TrainingDivergedError(OpdError):
    """Too many consecutive steps had a non-finite loss or gradient; the run stopped."""


class ResumableError(OpdError):
    """Something outside the run's process failed mid-run (a worker, a served teacher); the run stopped.

    Nothing of the run's own state was lost: rerunning the same command resumes from its newest checkpoint,
    which the training loop adds to the message.
    """


class WorkerError(ResumableError):
    """A worker of a distributed run died, ran out of memory or failed; the run stopped.

    Attributes:
        role: the worker group (``trainer``, ``rollout``, ``teacher``).
        rank: the worker's rank in its group.
    """

    def __init__(self, message: str, role: str, rank: int) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (or its type's name if empty), for a one-line error or warning."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
