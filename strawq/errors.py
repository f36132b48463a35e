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


class NewerFormat(StrawqError):
    """A record (or the run) is in a newer on-disk format than this strawq reads. Not a
    ``CorruptRecord``: nothing quarantines or drops it; the part stops and is upgraded
    (``strawq.tasks.formats``)."""


class ConfigError(StrawqError, ValueError):
    """A configuration value or key is invalid."""


class DatasetError(StrawqError, ValueError):
    """A dataset could not be read, or one of its rows is malformed."""


class FencedOut(StrawqError, PermissionError):
    """A newer holder (collector epoch, lease generation) has taken over."""


class DoctorFailed(StrawqError):
    """A mount failed verification; a run must not start on it."""


class BatchTimeout(StrawqError, TimeoutError):
    """No batch was published before the caller's deadline (the trainer's reader)."""


class RunFinished(StrawqError):
    """The run has ended: the dataset's last pass is trained (every batch acked) and no
    batch is coming (``BatchReader.next_batch``; the ``finished`` record,
    ``strawq.tasks.finished``). A trainer loop stops here: save the last checkpoint, commit
    it, exit 0."""


class BracketTimeout(StrawqError, TimeoutError):
    """Live producers did not acknowledge a pause before the deadline."""

    def __init__(self, message: str, missing: dict[str, float]) -> None:
        super().__init__(message)
        #: producer -> seconds since its heartbeat counter last moved (grantor's clock)
        self.missing = missing


class BracketError(StrawqError, RuntimeError):
    """The weight-update bracket was used out of order (end without begin, ...)."""


#: What to do about the common ``OSError`` causes, by errno name.
_OS_HINTS = {
    "ENOENT": "check the path",
    "ENOTDIR": "a part of the path is a file, not a directory: check the path",
    "EISDIR": "expected a file, found a directory: name the file",
    "EACCES": "check its permissions (or run as a user who may)",
    "EPERM": "check its permissions (or run as a user who may)",
    "EROFS": "the filesystem is read-only: choose a writable path",
    "ENOSPC": "the filesystem is full: free space or choose another path",
    "EDQUOT": "the disk quota is exceeded: free space or choose another path",
    "EADDRINUSE": "another process listens there: choose another port (0 picks a free one)",
    "ECONNREFUSED": "nothing listens there: start it, or check the address",
}


def os_error_text(exc: OSError, doing: str | None = None, path: object = None) -> str:
    """An ``OSError`` in words, without Python's ``[Errno N]`` prefix: what failed on which
    path, why (the system's reason), and what to do, e.g. ``cannot read /x/run.json: no such
    file or directory (check the path)``; without ``doing``, ``/x/run.json: no such ...``."""
    import errno as _errno
    import os as _os

    where = path if path is not None else exc.filename
    if exc.strerror:
        reason = exc.strerror
    elif exc.errno:
        reason = _os.strerror(exc.errno)
    else:  # raised by code, not the system: its message is the reason
        reason = str(exc) or type(exc).__name__
    if exc.strerror or exc.errno:
        reason = reason[:1].lower() + reason[1:]
    hint = _OS_HINTS.get(_errno.errorcode.get(exc.errno or -1, ""), "")
    if doing:
        head = f"cannot {doing}" + (f" {where}" if where is not None else "")
    else:
        head = str(where) if where is not None else ""
    text = f"{head}: {reason}" if head else reason
    return text + (f" ({hint})" if hint else "")
