"""Errors raised while talking to SGLang-protocol engines.

Every error carries the worker URL it concerns (``url``) so that an operator can tell
which engine misbehaved. All of them derive from :class:`EngineError`; each subclass also
inherits the builtin that fits, so callers that only know builtins still catch them.
"""

from __future__ import annotations

from strawq.errors import StrawqError


class EngineError(StrawqError, RuntimeError):
    """Base class of every engine-side failure seen by the client.

    It derives from :class:`strawq.errors.StrawqError` (one base for the project) and from
    ``RuntimeError`` (what callers that only know builtins expect).
    """

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message if url is None else f"{message} [worker {url}]")
        self.url = url


class EngineUnavailable(EngineError, ConnectionError):
    """The engine could not be reached (refused, reset, disappeared, 5xx) after retries."""


class EngineTimeout(EngineUnavailable, TimeoutError):
    """The engine did not answer within the deadline, after retries."""


class EngineProtocolError(EngineError, ValueError):
    """The engine answered, but the answer does not match the SGLang 0.5.x protocol.

    Such a response is never stored: a sample is only ever mutated from a response that
    passed every shape and length check.
    """


class EngineRequestError(EngineError, ValueError):
    """The engine rejected the request (HTTP 4xx); retrying the same request will not help."""

    def __init__(self, message: str, *, url: str | None = None, status: int = 400) -> None:
        super().__init__(message, url=url)
        self.status = status


class WeightUpdateRefused(EngineRequestError):
    """An engine refused a weight update (``success: false``, usually HTTP 400).

    SGLang 0.5.23 answers 400 "Weights were updated, but the cache was not flushed…" when
    requests still run or wait on an ``in_place``-paused engine; the new weights may be
    loaded while the version label is not. ``url`` names the worker; ``reply`` holds the
    engine's answer when it sent one.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        status: int = 400,
        reply: object = None,
    ) -> None:
        super().__init__(message, url=url, status=status)
        self.reply = reply


class EngineAuthError(EngineRequestError, PermissionError):
    """The engine answered 401/403: the API key (or the admin key) is missing or wrong."""
