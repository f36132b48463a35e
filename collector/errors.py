"""Errors of the collector package (all also ``strawq.errors.StrawqError``).

A stale collector raises ``strawq.errors.FencedOut`` itself (the queue core's fencing error),
so callers catch one type for "someone newer took over" wherever it comes from.

The trainer side's errors (``BatchTimeout``, ``RunFinished``, ``BracketTimeout``,
``BracketError``) live in
the core, ``strawq.errors``, because the trainer library (``strawq.collector.trainer``) never
imports the collector process; they are re-exported here so that ``from strawq.collector
import BatchTimeout`` keeps working. They are ``StrawqError``s, not ``CollectorError``s.
"""

from __future__ import annotations

from strawq.errors import BatchTimeout, BracketError, BracketTimeout, RunFinished, StrawqError


class CollectorError(StrawqError):
    """Base class of the errors the collector process raises."""


class CollectorBusy(CollectorError, RuntimeError):
    """Another collector holds this run and its heartbeat still moves."""


__all__ = ["BatchTimeout", "BracketError", "BracketTimeout", "CollectorBusy",
           "CollectorError", "RunFinished"]
