"""The publish discipline on this mount: fsync, ``RENAME_NOREPLACE``, no torn records.

A published record is durable only if fsync works on files and directories, exclusive
only if ``renameat2(RENAME_NOREPLACE)`` refuses an existing target, and whole only if a
concurrent reader (on the peer mount when given) never sees it partial.
"""

from __future__ import annotations

import errno
import os
import queue
import time
from typing import Any

from strawq.doctor.primitives import (
    _errname,
    _frame,
    _fsync_dir,
    _intact,
    _poll,
    _publish,
    _read_small,
    _renameat2_noreplace,
)
from strawq.doctor.report import Check, Status


def _torn_reader(directory: str, expected: int, deadline_s: float, ready: Any, stop: Any,
                 results: Any) -> None:
    """Read every name the moment it is listed; record any that is not whole."""
    seen: set[str] = set()
    torn: list[str] = []
    end = time.monotonic() + deadline_s
    ready.set()
    try:
        while time.monotonic() < end and not stop.is_set():
            names = [n for n in os.listdir(directory) if not n.startswith(".")]
            for name in names:
                if name in seen or name == "done":
                    continue
                seen.add(name)
                try:
                    with open(os.path.join(directory, name), "rb") as f:
                        data = f.read()
                except OSError as exc:
                    torn.append(f"{name}: listed but unreadable ({_errname(exc)})")
                    continue
                if not _intact(data):
                    torn.append(f"{name}: {len(data)} bytes, not the whole record")
            if "done" in names and len(seen) >= expected:
                break
            time.sleep(0.0005)
    except Exception as exc:  # noqa: BLE001 - reported as a finding, never a hang
        torn.append(f"reader error: {type(exc).__name__}: {exc}")
    results.put((len(seen), torn))


def _torn_check(scratch: str, reader_dir: str, files: int, size: int, ctx: Any,
                deadline_s: float) -> Check:
    """Publish ``files`` records while another process (on the peer, if any) reads them."""
    os.makedirs(os.path.join(scratch, "pub"))
    _fsync_dir(scratch)
    _, missing = _poll({"pub": time.perf_counter()}, lambda _: os.path.isdir(reader_dir),
                       deadline_s)
    if missing:
        return Check("publish_no_torn", Status.FAIL, f"{reader_dir} never appeared")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_torn_reader, name="strawq-doctor-reader", daemon=True,
                         args=(reader_dir, files, deadline_s + files, ready, stop, results))
    reader.start()
    try:
        if not ready.wait(deadline_s + 30):
            return Check("publish_no_torn", Status.FAIL, "the reader process did not start")
        for i in range(files):
            _publish(scratch, f"pub/r{i}", _frame(os.urandom(size)))
        _publish(scratch, "pub/done", b"done")
        try:
            seen, torn = results.get(timeout=deadline_s + files + 30)
        except queue.Empty:
            return Check("publish_no_torn", Status.FAIL, "the reader process did not report")
    finally:
        stop.set()  # a publish failed (ENOSPC...) or all is read: the reader ends now
        reader.join(timeout=5)
        if reader.is_alive():
            reader.terminate()
    measured = {"publish_files": float(files), "publish_torn_reads": float(len(torn)),
                "publish_bytes": float(size)}
    what = (f"{files} records of {size // 1024} KiB published by tmp+fsync+close+rename, "
            "read concurrently by another process")
    if torn:
        return Check("publish_no_torn", Status.FAIL, f"{what}: {len(torn)} torn reads, e.g. "
                     f"{torn[0]}", measured)
    if seen < files:
        return Check("publish_no_torn", Status.FAIL, f"{what}: the reader saw only {seen} of "
                     f"{files} within {deadline_s:g}s", measured)
    return Check("publish_no_torn", Status.PASS, f"{what}: every read whole", measured)


def _fsync_checks(scratch: str) -> list[Check]:
    checks: list[Check] = []
    path = os.path.join(scratch, "fsync-probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, os.urandom(64 * 1024))
            t0 = time.perf_counter()
            os.fsync(fd)
            took = time.perf_counter() - t0
            os.fdatasync(fd)
        finally:
            os.close(fd)
        checks.append(Check("fsync_file", Status.PASS, f"fsync of a 64 KiB file: "
                            f"{took * 1e3:.2f} ms", {"fsync_file_s": took}))
    except OSError as exc:
        checks.append(Check("fsync_file", Status.FAIL, f"fsync of a file failed: "
                            f"{_errname(exc)} {exc.strerror}; nothing published here would "
                            "be durable"))
    try:
        t0 = time.perf_counter()
        _fsync_dir(scratch)
        took = time.perf_counter() - t0
        checks.append(Check("fsync_dir", Status.PASS, f"fsync of a directory: "
                            f"{took * 1e3:.2f} ms", {"fsync_dir": 1.0, "fsync_dir_s": took}))
    except OSError as exc:
        status = Status.WARN if exc.errno == errno.EINVAL else Status.FAIL
        checks.append(Check("fsync_dir", status, f"fsync of a directory failed: "
                            f"{_errname(exc)}; a crash right after a rename may lose it",
                            {"fsync_dir": 0.0}))
    return checks


def _noreplace_probe(scratch: str) -> Check:
    a, b = os.path.join(scratch, "nr-probe-a"), os.path.join(scratch, "nr-probe-b")
    for p, body in ((a, b"a"), (b, b"b")):
        with open(p, "wb") as f:
            f.write(body)
    try:
        _renameat2_noreplace(a, b)
    except OSError as exc:
        if exc.errno == errno.EEXIST and _read_small(b) == "b" and os.path.exists(a):
            return Check("rename_noreplace", Status.PASS, "renameat2(RENAME_NOREPLACE) "
                         "refuses an existing target (EEXIST), target unchanged",
                         {"rename_noreplace": 1.0})
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            return Check("rename_noreplace", Status.WARN, f"renameat2(RENAME_NOREPLACE) is "
                         f"unsupported ({_errname(exc)}): PosixStorage falls back to "
                         "check-then-rename, so two writers publishing the same key could "
                         "both succeed (the queue's keys are unique by construction)",
                         {"rename_noreplace": 0.0})
        return Check("rename_noreplace", Status.FAIL, f"renameat2(RENAME_NOREPLACE) failed "
                     f"with {_errname(exc)} {exc.strerror}", {"rename_noreplace": 0.0})
    return Check("rename_noreplace", Status.FAIL, "renameat2(RENAME_NOREPLACE) replaced an "
                 f"existing file (target now holds {_read_small(b)!r}): exclusive publish is "
                 "broken on this filesystem", {"rename_noreplace": 0.0})
