"""The storage contract: keys, bytes and atomic name operations.

A store knows nothing about tasks or tensors. Keys are ``/``-separated relative paths whose
components are validated (docs/design.md, invariant 7): they become file names on a shared mount.

The only primitives the queue relies on are:

* ``publish(key, data)`` — write to a unique temporary name, fsync, close, then move into
  place *without replacing* an existing key, then fsync the directory (docs/design.md, invariant 2).
  A reader on any client sees either nothing or the whole record.
* ``rename(src, dst)`` — atomic, exactly one winner when several callers move the same
  ``src``; never replaces ``dst``. This is what claims, completes and fences.
* ``list(dir)`` — names directly inside a directory, dot-files skipped (NFS silly renames).

One more, optional (``Capabilities.append``): ``append(key, data)`` adds bytes at the end of
a file its one writer owns and fsyncs them (the in-flight journal's segments,
``strawq.tasks.journal``); a crash mid-append can leave a prefix of them at the end, which
the appended data's own framing finds.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from strawq.errors import ConfigError

_COMPONENT = re.compile(r"[A-Za-z0-9_+=-][A-Za-z0-9._~+=-]{0,199}")


def validate_key(key: str) -> str:
    """Return ``key`` if every component is a safe file name, else raise ``ConfigError``."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise ConfigError(f"invalid storage key {key!r}: expected a relative path like 'a/b'")
    for part in key.split("/"):
        if part in (".", "..") or not _COMPONENT.fullmatch(part):
            raise ConfigError(
                f"invalid storage key {key!r}: component {part!r} must match "
                f"{_COMPONENT.pattern} (no dot-files, no '..', at most 200 characters)"
            )
    return key


def parent(key: str) -> str:
    """The directory part of ``key`` ('' for a top-level key)."""
    return key.rpartition("/")[0]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend guarantees. Every ``True`` is backed by a conformance test."""

    #: ``rename`` is atomic with one winner and never replaces its destination.
    atomic_rename: bool = True
    #: ``publish`` refuses an existing key atomically (O_EXCL / link / RENAME_NOREPLACE).
    exclusive_create: bool = True
    #: data is durable once ``publish`` returns (file fsync + directory fsync).
    durable: bool = True
    #: several processes (and hosts, for a shared mount) can use the store at once.
    multi_process: bool = True
    #: ``local_path`` gives a real path that can be memory-mapped.
    mmap: bool = True
    #: ``append`` adds bytes at the end of an existing file, durable when it returns.
    append: bool = False


class Storage(abc.ABC):
    """Abstract key/bytes store with atomic publish and rename."""

    capabilities: Capabilities = Capabilities()

    #: A short identifier of this writer, used in temporary names.
    writer_id: str = "w"

    @abc.abstractmethod
    def publish(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                sync_dir: bool = True, sync_file: bool = True, in_place: bool = False) -> None:
        """Atomically create ``key`` with ``data``; ``AlreadyExists`` if it exists.

        ``data`` may be a sequence of buffers written back to back (no concatenation copy).
        With ``sync_dir=False`` the caller promises to call ``sync_dirs`` on the parent
        before it reports success to anyone (batched directory fsyncs: docs/protocol.md §3,
        "Complete / yield"). With ``sync_file=False`` the content is not fsync'd either: only for
        data whose loss in a power failure is harmless (heartbeat counters).

        ``in_place=True`` writes the file at ``key`` itself (exclusive create, write, fsync,
        close) with no temporary name and no rename, so the name exists before the content
        is complete: only for a key nobody reads until a later rename commits it, made after
        the file was closed. Either a key inside a private directory that is itself renamed
        into place (a release being staged, a cursor commit being prepared; a crash can
        leave a partial file there, and such a directory is never committed and is
        discarded whole), or a lease's payload, which only the lease's fencing rename names
        (``RunQueue.complete``; a crash can leave a partial payload that no entry names,
        swept once the task moves on). The durability is the same (file fsync; the
        directory fsync as ``sync_dir`` says).
        """

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The whole content of ``key``; ``NotFound`` if absent."""

    @abc.abstractmethod
    def read_prefix(self, key: str, size: int) -> bytes:
        """At most the first ``size`` bytes of ``key``."""

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        """At most ``size`` bytes of ``key`` from byte ``offset`` (fewer at its end, none
        past it); ``NotFound`` if absent. The base reads the whole file; a backend may read
        only the range (``PosixStorage``: ``pread``)."""
        return self.read(key)[offset:offset + size]

    @abc.abstractmethod
    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        """Atomically move ``src`` to ``dst``.

        ``NotFound`` if ``src`` is gone (somebody else won), ``AlreadyExists`` if ``dst``
        exists. Directories are renamed the same way.
        """

    def rename_within(self, directory: str, src: str, dst: str) -> None:
        """``rename(directory/src, directory/dst, sync_dir=False)``: a move between two names
        of one directory, made often (a heartbeat). A backend may resolve ``directory`` once
        per handle and name only ``src`` and ``dst`` at each call (``PosixStorage``: a held
        descriptor, so a shared mount does not look every path component up again); the
        outcomes are ``rename``'s."""
        if "/" in src or "/" in dst:
            raise ValueError(f"rename_within {directory}: {src!r} and {dst!r} must be names "
                             f"inside it, not paths")
        self.rename(f"{directory}/{src}", f"{directory}/{dst}", sync_dir=False)

    def append(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
        """Add ``data`` at the end of the existing file ``key`` and fsync it (durable when
        this returns, as far as the store is: ``Capabilities.durable``); ``NotFound`` if
        ``key`` is absent.

        Only for a file exactly one writer appends to (a journal segment of its writer
        incarnation), made with ``publish`` (so a reader never sees it without its first
        bytes). A crash or an error mid-append can leave any prefix of ``data`` at the end:
        what is appended must be framed so that a reader finds such a torn tail
        (``strawq.tasks.journal``); after an error the writer appends to that file no more.
        A backend may hold the file open between appends (``end_append`` closes it). A
        backend without the capability (``Capabilities.append`` False) raises
        ``NotImplementedError``: its callers keep a file per record instead."""
        raise NotImplementedError(f"{self.describe()} cannot append to {key}")

    def end_append(self, key: str) -> None:
        """The writer appends to ``key`` no more: a file held open between appends is closed
        (nothing else changes; ``delete`` of the key does the same)."""
        return None

    @abc.abstractmethod
    def list(self, directory: str) -> list[str]:
        """Sorted names directly inside ``directory`` ([] if it does not exist)."""

    @abc.abstractmethod
    def delete(self, key: str, *, missing_ok: bool = True) -> None:
        """Remove a file."""

    @abc.abstractmethod
    def rmdir(self, directory: str) -> bool:
        """Remove an *empty* directory; False if it is not empty or absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` names a file or directory."""

    @abc.abstractmethod
    def is_dir(self, key: str) -> bool:
        """Whether ``key`` names a directory."""

    @abc.abstractmethod
    def makedirs(self, directory: str) -> None:
        """Create ``directory`` and its parents (durably)."""

    @abc.abstractmethod
    def sync_dirs(self, directories: Iterable[str]) -> None:
        """fsync each directory once (after batched ``sync_dir=False`` operations)."""

    def local_path(self, key: str) -> str | None:
        """A path for memory-mapping, or None when the backend has none."""
        return None

    def clean_tmp(self, writer_prefix: str) -> int:
        """Remove temporary files of a writer known to be gone; returns how many."""
        return 0

    def clean_dead_tmp(self, *, grace_s: float = 3600.0) -> int:
        """Remove temporary files of writers that are dead, found without naming them."""
        return 0

    def size(self, key: str) -> int:
        """Size in bytes of ``key``."""
        return len(self.read(key))

    def describe(self) -> str:
        """A one-line description for logs and ``strawq status``."""
        return type(self).__name__
