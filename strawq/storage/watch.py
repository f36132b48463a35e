"""Wake-ups on directory changes: inotify where the kernel sees the change, a fixed poll else.

Sleeping and listing again, with the sleep doubling while nothing comes, makes a waiter late
by up to its longest sleep (a reader polling at 0.5 s leaves a batch published just after a
listing unseen that long). A ``DirWatch`` waits instead:

* **Event-driven** where the kernel sees the change: Linux inotify on the watched
  directories. That covers a local disk, and a FUSE or NFS mount for every change made
  through the same mount on this host (the demo, one node's producer and collector).
* **Cheap** where it does not (a change made by another host on a shared mount: inotify
  never hears of it): ``wait`` returns after the caller's poll interval at the latest, and
  the caller looks again. The interval is fixed — no back-off — so the worst case delay is
  one interval. A ``DirProbe`` makes the look a ``stat`` of the directory, and the listing
  happens only when its mtime moved (idle producers: one getattr per directory per
  attribute-cache TTL on JuiceFS instead of two listings per poll).

An event only means "look again": callers always re-list, so a missed, merged or spurious
event costs latency or one listing, never correctness. Names in the events are returned for
tracing (``strawq.demo.hops``), not relied upon.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Sequence

from strawq.storage.base import Storage

log = logging.getLogger(__name__)

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

#: entries appearing in or leaving a directory: what a queue transition looks like
ENTRY_EVENTS = IN_CREATE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM
_HEADER = struct.Struct("iIII")

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    _init1 = getattr(_libc, "inotify_init1", None)
    _add_watch = getattr(_libc, "inotify_add_watch", None)
except OSError:  # pragma: no cover - non-glibc platforms
    _libc = _init1 = _add_watch = None


def inotify_available() -> bool:
    return _init1 is not None and _add_watch is not None


class Event(tuple[str, str, int, float]):
    """(directory, name, mask, monotonic time read): one directory entry changed."""

    __slots__ = ()

    @property
    def directory(self) -> str:
        return self[0]

    @property
    def name(self) -> str:
        return self[1]

    @property
    def mask(self) -> int:
        return self[2]

    @property
    def at(self) -> float:
        return self[3]


class DirWatch:
    """Watches directories of a store (keys relative to its root) for entry changes.

    ``wait(timeout)`` returns True as soon as a change was seen (False after ``timeout``
    without one); ``fileno()`` lets an event loop wait on it (``loop.add_reader``), then
    ``drain()`` clears it. Without inotify (another OS, a store without local paths, or
    ``enabled=False``) ``wait`` simply sleeps ``timeout``: the caller's fixed poll.
    Thread-safe for one waiter and any number of ``add`` callers.
    """

    def __init__(self, storage: Storage | None, dirs: Sequence[str] = (), *,
                 mask: int = ENTRY_EVENTS, enabled: bool = True, keep_events: bool = False,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.storage = storage
        self.mask = mask
        self.keep_events = keep_events
        self.sleep = sleep
        self.clock = clock
        self.events: list[Event] = []
        self._fd: int | None = None
        self._wds: dict[int, str] = {}
        self._lock = threading.Lock()
        if enabled and inotify_available() and storage is not None \
                and storage.local_path("tmp") is not None:
            assert _init1 is not None
            fd = _init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                log.warning("inotify unavailable (%s): waits fall back to fixed polls",
                            os.strerror(ctypes.get_errno()))
            else:
                self._fd = fd
        for d in dirs:
            self.add(d)

    @property
    def event_driven(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int | None:
        return self._fd

    def add(self, directory: str) -> bool:
        """Watch one more directory; False if it cannot be watched (gone, or no inotify)."""
        if self._fd is None or self.storage is None:
            return False
        path = self.storage.local_path(directory)
        if path is None:
            return False
        assert _add_watch is not None
        wd = _add_watch(self._fd, os.fsencode(path), self.mask | IN_ONLYDIR)
        if wd < 0:
            code = ctypes.get_errno()
            if code not in (errno.ENOENT, errno.ENOTDIR):
                log.warning("cannot watch %s (%s): changes there are seen by polling only",
                            path, os.strerror(code))
            return False
        with self._lock:
            self._wds[wd] = directory
        return True

    def drain(self) -> bool:
        """Consume pending events; True if there were any."""
        fd = self._fd
        if fd is None:
            return False
        seen = False
        while True:
            try:
                buf = os.read(fd, 65536)
            except BlockingIOError:
                return seen
            except OSError as exc:  # pragma: no cover - a closed descriptor
                if exc.errno == errno.EBADF:
                    return seen
                raise
            if not buf:
                return seen
            seen = True
            if self.keep_events:
                self._parse(buf)

    def _parse(self, buf: bytes) -> None:
        now = self.clock()
        off = 0
        with self._lock:
            while off + _HEADER.size <= len(buf):
                wd, mask, _cookie, length = _HEADER.unpack_from(buf, off)
                raw = buf[off + _HEADER.size: off + _HEADER.size + length]
                off += _HEADER.size + length
                if mask & IN_IGNORED:
                    self._wds.pop(wd, None)
                    continue
                name = raw.split(b"\0", 1)[0].decode(errors="replace")
                self.events.append(Event((self._wds.get(wd, "?"), name, mask, now)))

    def take_events(self) -> list[Event]:
        """Drain, then return and forget the events kept so far (``keep_events=True``)."""
        self.drain()
        with self._lock:
            out, self.events = self.events, []
        return out

    def wait(self, timeout: float) -> bool:
        """Block until a change is seen (True) or ``timeout`` passes (False)."""
        timeout = max(timeout, 0.0)
        fd = self._fd
        if fd is None:
            self.sleep(timeout)
            return False
        if self.drain():
            return True
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except (OSError, ValueError):  # closed under us
            return False
        return bool(ready) and self.drain()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # an unclosed watch must not hold an inotify instance
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DirProbe:
    """Has a directory changed since the last look? One ``stat`` instead of a listing.

    The cheap wake-up where no event comes (another host's change on a shared mount): an
    idle poller stats the directories it would list and lists only when one changed. A
    directory's mtime moves with every entry added or removed; it is compared for
    *equality* with the last value this process saw (never with a clock, never across
    hosts). On a FUSE mount the stat is answered from the kernel's attribute cache within
    its TTL (JuiceFS ``--attr-cache``, 1 s by default), so an idle poller costs at most one
    metadata operation per directory per TTL however often it polls, and sees a change at
    most one TTL late.

    Two changes inside one timestamp tick (a few ms on ext4) leave one mtime: after every
    change seen, the next look reports a change too, so a second change of the same tick
    is listed one poll later. ``full_every_s`` bounds how long a look may say "unchanged"
    (a filesystem that does not move directory mtimes still gets listed that often).

    The look is an ``fstat`` of a descriptor held open on the directory: no path lookup
    (each path component would cost a lookup per entry-cache TTL on a FUSE mount). The
    descriptor is reopened by path at every full listing, so a directory replaced under
    it is noticed.
    """

    def __init__(self, storage: Storage | None, dirs: Sequence[str], *,
                 full_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = [storage.local_path(d) if storage is not None else None for d in dirs]
        self.full_every_s = full_every_s
        self.clock = clock
        self._seen: list[tuple[int, int] | None] = [None] * len(self.paths)
        self._fds: list[int | None] = [None] * len(self.paths)
        self._again = True
        self._last_true = -float("inf")

    def _stat(self, i: int, path: str, reopen: bool) -> tuple[int, int] | None:
        fd = self._fds[i]
        if fd is not None and reopen:
            os.close(fd)
            fd = self._fds[i] = None
        try:
            if fd is None:
                fd = self._fds[i] = os.open(path, os.O_RDONLY | os.O_DIRECTORY
                                            | getattr(os, "O_CLOEXEC", 0))
            st = os.fstat(fd)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def close(self) -> None:
        for i, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[i] = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def changed(self) -> bool:
        """True when a listing is due: a directory changed, or it may have."""
        now = self.clock()
        full = now - self._last_true >= self.full_every_s
        changed = self._again or full
        for i, path in enumerate(self.paths):
            if path is None:
                changed = True  # no local path (an in-memory store): always list
                continue
            key = self._stat(i, path, reopen=full)
            if key != self._seen[i]:
                self._seen[i] = key
                changed = True
        # one more listing after any change: a second change in the same mtime tick
        self._again = changed and not self._again
        if changed:
            self._last_true = now
        return changed
