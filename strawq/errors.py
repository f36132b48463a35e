"""The one exception hierarchy of the queue core.

Every error also inherits the builtin that fits, so callers that only know Python's
exceptions (``KeyError``, ``FileExistsError``, ``OSError``) still catch the right thing.
Messages say what was expected, what was found, and what to do next.
"""

from __future__ import annotations


class StrawqError(Exception):
    """Base class of every error raised by ``strawq``."""


class NotFound(StrawqError, FileNotFoundError):
    """A key, record or task does not exist (or no longer exists)."""


class TaskNotFound(NotFound, KeyError):
    """A task id is in none of the states the caller looked in."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "task not found"


class AlreadyExists(StrawqError, FileExistsError):
    """An exclusive create or a no-replace rename found its target already present."""


class LeaseLost(StrawqError):
    """The caller's lease was expired, re-leased or revoked; its result is fenced off."""


class StorageError(StrawqError, OSError):
    """An I/O error at the storage boundary (translated from ``OSError``)."""


class StorageFull(StorageError):
    """The filesystem reported ENOSPC or EDQUOT; nothing was published."""


class CorruptRecord(StrawqError, ValueError):
    """A record failed its framing, schema-version or checksum checks."""


class ConfigError(StrawqError, ValueError):
    """A configuration value or key is invalid."""


class DatasetError(StrawqError, ValueError):
    """A dataset could not be read, or one of its rows is malformed."""


class FencedOut(StrawqError, PermissionError):
    """A newer holder (collector epoch, lease generation) has taken over."""


class DoctorFailed(StrawqError):
    """A mount failed verification; a run must not start on it."""
