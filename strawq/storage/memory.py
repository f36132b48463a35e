"""In-memory backend for fast unit tests and the Hypothesis model.

One process only (``multi_process=False``), nothing durable. Its semantics otherwise match
the POSIX backend, which the conformance suite checks for both.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterable, Sequence

from strawq.errors import AlreadyExists, NotFound
from strawq.storage.base import Capabilities, Storage, parent, validate_key


class MemoryStorage(Storage):
    """A dict of keys to bytes plus a set of directories, guarded by one lock."""

    capabilities = Capabilities(durable=False, multi_process=False, mmap=False, append=True)

    def __init__(self, *, writer_id: str = "mem") -> None:
        self.writer_id = writer_id
        self._files: dict[str, bytes] = {}
        self._dirs: set[str] = {""}
        self._lock = threading.RLock()

    def _ensure_parents(self, key: str) -> None:
        d = parent(key)
        while d not in self._dirs:
            self._dirs.add(d)
            d = parent(d)

    def publish(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                sync_dir: bool = True, sync_file: bool = True, in_place: bool = False) -> None:
        validate_key(key)
        if isinstance(data, (bytes, bytearray, memoryview)):
            blob = bytes(data)
        else:
            blob = b"".join(bytes(c) for c in data)
        with self._lock:
            if key in self._files or key in self._dirs:
                raise AlreadyExists(errno.EEXIST, f"publish {key}: already exists")
            self._ensure_parents(key)
            self._files[key] = blob

    def append(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
        validate_key(key)
        if isinstance(data, (bytes, bytearray, memoryview)):
            blob = bytes(data)
        else:
            blob = b"".join(bytes(c) for c in data)
        with self._lock:
            if key not in self._files:
                raise NotFound(errno.ENOENT, f"append {key}: no such key")
            self._files[key] += blob

    def read(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._files[validate_key(key)]
            except KeyError:
                raise NotFound(errno.ENOENT, f"read {key}: no such key") from None

    def read_prefix(self, key: str, size: int) -> bytes:
        return self.read(key)[:size]

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        return self.read(key)[offset:offset + size]

    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        validate_key(src)
        validate_key(dst)
        with self._lock:
            if src not in self._files and src not in self._dirs:
                # POSIX order: a missing source is ENOENT even when the destination exists
                raise NotFound(errno.ENOENT, f"rename {src} -> {dst}: source is gone")
            if dst in self._files or dst in self._dirs:
                raise AlreadyExists(errno.EEXIST, f"rename {src} -> {dst}: destination exists")
            if src in self._files:
                self._ensure_parents(dst)
                self._files[dst] = self._files.pop(src)
                return
            if src in self._dirs:
                self._ensure_parents(dst)
                pre = src + "/"
                for k in [k for k in self._files if k.startswith(pre)]:
                    self._files[dst + "/" + k[len(pre):]] = self._files.pop(k)
                for d in [d for d in self._dirs if d == src or d.startswith(pre)]:
                    self._dirs.discard(d)
                    self._dirs.add(dst + d[len(src):])
                return
            raise NotFound(errno.ENOENT, f"rename {src} -> {dst}: source is gone")

    def list(self, directory: str) -> list[str]:
        pre = directory + "/" if directory else ""
        with self._lock:
            names = {k[len(pre):].split("/", 1)[0] for k in self._files if k.startswith(pre)}
            names |= {d[len(pre):].split("/", 1)[0] for d in self._dirs
                      if d.startswith(pre) and d != directory and d}
        return sorted(n for n in names if n and not n.startswith("."))

    def delete(self, key: str, *, missing_ok: bool = True) -> None:
        with self._lock:
            if self._files.pop(validate_key(key), None) is None and not missing_ok:
                raise NotFound(errno.ENOENT, f"delete {key}: no such key")

    def rmdir(self, directory: str) -> bool:
        with self._lock:
            if directory not in self._dirs or self.list(directory):
                return False
            self._dirs.discard(directory)
            return True

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._files or key in self._dirs

    def is_dir(self, key: str) -> bool:
        with self._lock:
            return key in self._dirs

    def makedirs(self, directory: str) -> None:
        validate_key(directory)
        with self._lock:
            self._ensure_parents(directory + "/x")

    def sync_dirs(self, directories: Iterable[str]) -> None:
        return None

    def size(self, key: str) -> int:
        return len(self.read(key))

    def describe(self) -> str:
        return "memory"
