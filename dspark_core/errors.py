"""Domain exceptions of dspark_core.

A handful of classes, each meaning one thing to a caller. Entry points map them once: the CLI to a
one-line message and exit code 2, the gRPC services to status codes in one interceptor. Every message
names the offending field and value.
"""

from __future__ import annotations


class DSparkError(Exception):
    """Base class of every error dspark_core raises on purpose."""


class InvalidArgument(DSparkError, ValueError):
    """A caller passed a value that can never work (bad field, bad range, empty prompt...)."""

    def __init__(self, field: str, value: object, requirement: str):
        self.field, self.value, self.requirement = field, value, requirement
        super().__init__(f"{field} {requirement}; got {_shown(value)}")


MAX_SHOWN_CHARS = 120


def _shown(value: object) -> str:
    """`repr(value)` cut to MAX_SHOWN_CHARS: an error echoes what the caller sent, not all of it (a client's
    4,000-digit integer or megabyte string would otherwise come back whole, and an int past Python's digit
    limit cannot even be printed)."""
    try:
        text = repr(value)
    except ValueError:  # int past sys.get_int_max_str_digits()
        return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS - 20]}... ({len(text):,} characters)"


class ModelLoadError(DSparkError):
    """A model directory is missing, incomplete or not a supported architecture."""


class ResourceExhausted(DSparkError):
    """Capacity is full (context window, queue, KV budget); the request may succeed later or smaller."""


class KVCacheFull(ResourceExhausted):
    """The KV store has no room for a request now; `fits_alone`: it would fit once the others are done."""

    def __init__(self, message: str, fits_alone: bool):
        super().__init__(message)
        self.fits_alone = fits_alone


class NotFound(DSparkError):
    """A named thing (request id, model name, replica) does not exist."""
