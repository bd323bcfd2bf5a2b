"""Text helpers for opd's own error and warning messages."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, for a one-line error or warning.

    Libraries such as OmegaConf, W&B and MLflow append multi-line context to their
    messages; opd quotes only the first line inside its own message.

    Args:
        error: the exception to describe.

    Returns:
        The first line of ``str(error)`` without surrounding whitespace, or the name of
        the exception's type when the message is empty.
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
