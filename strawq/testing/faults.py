"""A fault-injecting wrapper around any store, for crash and error-path tests.

* ``errors={"publish": (3, errno.ENOSPC)}`` — the 3rd ``publish`` raises that error.
* ``crash_after=N`` — the N-th mutating operation (publish, rename, delete, rmdir) raises
  ``CrashPoint`` *before* it happens, modelling a process killed right there; the wrapped
  store keeps exactly what a real crash would leave. An ``in_place`` publish has a second
  point, inside it: the file is left at its key with half its bytes.
* ``append`` is mutating too, with a second crash point inside it: half the appended bytes
  reach the file (a torn tail), then ``CrashPoint``.
* ``phantom_enoent={"rename": 2}`` — the 2nd rename happens but reports ENOENT, as a
  retried NFS RPC can.
* ``seed``/``error_rate`` — random ``EIO`` on any operation, reproducible per seed.
"""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterable, Sequence

from strawq.errors import NotFound
from strawq.storage.base import Storage
from strawq.storage.posix import translate

_MUTATING = ("publish", "rename", "delete", "rmdir", "append")


class CrashPoint(BaseException):
    """Raised in place of the operation at which the simulated process dies.

    A ``BaseException`` so that library ``except Exception`` blocks cannot swallow it.
    """


class FaultyStorage(Storage):
    def __init__(self, inner: Storage, *, errors: dict[str, tuple[int, int]] | None = None,
                 crash_after: int | None = None, phantom_enoent: dict[str, int] | None = None,
                 seed: int | None = None, error_rate: float = 0.0) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.writer_id = inner.writer_id
        self._errors = dict(errors or {})
        self._crash_after = crash_after
        self._phantom = dict(phantom_enoent or {})
        self._rng = random.Random(seed)
        self._rate = error_rate
        self.counts: dict[str, int] = {}
        self.mutations = 0
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def _enter(self, op: str, *keys: str) -> None:
        n = self.counts[op] = self.counts.get(op, 0) + 1
        if op in _MUTATING:
            self.mutations += 1
            if self._crash_after is not None and self.mutations >= self._crash_after:
                raise CrashPoint(f"simulated crash before {op} {keys} (mutation {self.mutations})")
        spec = self._errors.get(op)
        if spec is not None and spec[0] == n:
            code = spec[1]
            raise translate(OSError(code, os.strerror(code)), f"{op} {' '.join(keys)}")
        if self._rate and self._rng.random() < self._rate:
            raise translate(OSError(errno.EIO, os.strerror(errno.EIO)), f"{op} {' '.join(keys)}")
        self.log.append((op, keys))

    def publish(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                sync_dir: bool = True, sync_file: bool = True, in_place: bool = False) -> None:
        self._enter("publish", key)
        if in_place:
            self._inside_in_place(key, data)
        self.inner.publish(key, data, sync_dir=sync_dir, sync_file=sync_file,
                           in_place=in_place)

    def _inside_in_place(self, key: str,
                         data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
        """One more crash point inside an ``in_place`` publish: the file exists at its key
        with half its bytes (what a crash mid-write leaves when there is no temporary name)."""
        self.mutations += 1
        if self._crash_after is not None and self.mutations >= self._crash_after:
            blob = (bytes(data) if isinstance(data, (bytes, bytearray, memoryview))
                    else b"".join(bytes(c) for c in data))
            self.inner.publish(key, blob[:len(blob) // 2], sync_dir=False, in_place=True)
            raise CrashPoint(f"simulated crash inside the in-place publish of {key} "
                             f"(mutation {self.mutations}): a partial file is left")

    def append(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
        self._enter("append", key)
        blob = (bytes(data) if isinstance(data, (bytes, bytearray, memoryview))
                else b"".join(bytes(c) for c in data))
        self.mutations += 1  # the point inside: half the bytes are at the end
        if self._crash_after is not None and self.mutations >= self._crash_after:
            self.inner.append(key, blob[:len(blob) // 2])
            raise CrashPoint(f"simulated crash inside the append to {key} (mutation "
                             f"{self.mutations}): a torn tail is left")
        self.inner.append(key, blob)

    def end_append(self, key: str) -> None:
        self.inner.end_append(key)

    def read(self, key: str) -> bytes:
        self._enter("read", key)
        return self.inner.read(key)

    def read_prefix(self, key: str, size: int) -> bytes:
        self._enter("read", key)
        return self.inner.read_prefix(key, size)

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        self._enter("read", key)
        return self.inner.read_range(key, offset, size)

    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        self._enter("rename", src, dst)
        self.inner.rename(src, dst, sync_dir=sync_dir)
        if self._phantom.get("rename") == self.counts["rename"]:
            raise NotFound(errno.ENOENT, f"rename {src} -> {dst}: (injected) reply lost")

    def list(self, directory: str) -> list[str]:
        self._enter("list", directory)
        return self.inner.list(directory)

    def delete(self, key: str, *, missing_ok: bool = True) -> None:
        self._enter("delete", key)
        self.inner.delete(key, missing_ok=missing_ok)

    def rmdir(self, directory: str) -> bool:
        self._enter("rmdir", directory)
        return self.inner.rmdir(directory)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def is_dir(self, key: str) -> bool:
        return self.inner.is_dir(key)

    def makedirs(self, directory: str) -> None:
        self.inner.makedirs(directory)

    def sync_dirs(self, directories: Iterable[str]) -> None:
        self.inner.sync_dirs(directories)

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def describe(self) -> str:
        return f"faulty({self.inner.describe()})"

    def clean_tmp(self, writer_prefix: str) -> int:
        return self.inner.clean_tmp(writer_prefix)

    def clean_dead_tmp(self, *, grace_s: float = 3600.0) -> int:
        return self.inner.clean_dead_tmp(grace_s=grace_s)
