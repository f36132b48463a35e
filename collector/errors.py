"""Errors of the collector package (all also ``strawq.errors.StrawqError``).

A stale collector raises ``strawq.errors.FencedOut`` itself (the queue core's fencing error),
so callers catch one type for "someone newer took over" wherever it comes from.
"""

from __future__ import annotations

from strawq.errors import StrawqError


class CollectorError(StrawqError):
    """Base class of every error raised by ``collector``."""


class CollectorBusy(CollectorError, RuntimeError):
    """Another collector holds this run and its heartbeat still moves."""


class BatchTimeout(CollectorError, TimeoutError):
    """No batch was published before the caller's deadline."""


class BracketTimeout(CollectorError, TimeoutError):
    """Live producers did not acknowledge a pause before the deadline."""

    def __init__(self, message: str, missing: dict[str, float]) -> None:
        super().__init__(message)
        #: producer -> seconds since its heartbeat counter last moved (grantor's clock)
        self.missing = missing


class BracketError(CollectorError, RuntimeError):
    """The weight-update bracket was used out of order (end without begin, ...)."""
