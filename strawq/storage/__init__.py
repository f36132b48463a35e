"""Storage backends: keys, bytes and atomic name operations (no Ray, torch or HTTP)."""

from __future__ import annotations

from strawq.storage.base import Capabilities, Storage, parent, validate_key
from strawq.storage.memory import MemoryStorage
from strawq.storage.posix import PosixStorage

__all__ = [
    "Capabilities",
    "MemoryStorage",
    "PosixStorage",
    "Storage",
    "open_storage",
    "parent",
    "validate_key",
]


def open_storage(url: str, *, writer_id: str | None = None, fsync: bool = True,
                 read_only: bool = False) -> Storage:
    """Open a store from a path or URL: ``/path``, ``file:///path`` or ``memory://``.

    ``read_only`` (POSIX) refuses writes and skips tidying: for tools that only look.
    """
    if url.startswith("memory://"):
        return MemoryStorage(writer_id=writer_id or "mem")
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        from strawq.errors import ConfigError

        raise ConfigError(
            f"unsupported queue location {url!r}: the queue needs atomic rename, so it lives "
            "on a POSIX path (local disk, or a JuiceFS/NFS mount); object-store URLs are "
            "accepted for datasets only"
        )
    return PosixStorage(url, writer_id=writer_id, fsync=fsync, read_only=read_only)
