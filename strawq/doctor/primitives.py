"""The file operations the checks are built from.

Each check must do exactly what the queue does (``strawq.storage.PosixStorage``): publish
by tmp + fsync + close + rename + directory fsync, and exclusive publish by
``renameat2(RENAME_NOREPLACE)``. They live here once so that the races, the publication
check and the visibility probes all measure the same discipline.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
try:
    _renameat2: Any = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
except OSError:  # pragma: no cover - non-glibc platforms
    _renameat2 = None


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _renameat2_noreplace(src: str, dst: str) -> None:
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this C library")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                  _RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dst)


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


_FRAME = struct.Struct("<Q32s")


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body), hashlib.sha256(body).digest()) + body


def _intact(data: bytes) -> bool:
    if len(data) < _FRAME.size:
        return False
    n, digest = _FRAME.unpack_from(data)
    body = data[_FRAME.size:]
    return bool(len(body) == n and hashlib.sha256(body).digest() == digest)


def _publish(scratch: str, rel: str, data: bytes, *, chunk: int = 64 * 1024) -> None:
    """tmp + fsync + close + rename + directory fsync, the queue's discipline."""
    tmp = os.path.join(scratch, "tmp", uuid.uuid4().hex)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for off in range(0, len(data), chunk):
            os.write(fd, data[off:off + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    dst = os.path.join(scratch, rel)
    os.rename(tmp, dst)
    _fsync_dir(os.path.dirname(dst))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _poll(pending: dict[str, float], probe: Callable[[str], bool], deadline_s: float
          ) -> tuple[dict[str, float], list[str]]:
    """Poll ``probe(name)`` for each name until true; delay since ``pending[name]``."""
    done: dict[str, float] = {}
    end = time.perf_counter() + deadline_s
    while len(done) < len(pending) and time.perf_counter() < end:
        for name, t0 in pending.items():
            if name not in done and probe(name):
                done[name] = max(0.0, time.perf_counter() - t0)
        if len(done) < len(pending):
            time.sleep(0.0005)
    return done, sorted(set(pending) - set(done))


def _exists(path: str) -> bool:
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def _write_synced(path: str, data: bytes) -> None:
    """Create (or truncate) ``path`` with ``data``, fsynced: race inputs are committed the
    way the queue commits a task before claimers race for it."""
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
