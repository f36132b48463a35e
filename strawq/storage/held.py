"""The descriptors a ``PosixStorage`` handle holds: its run root's, through which every call
names its key (``dir_fd=``), and those of directories it renames within; how a call
resolves keys against them (``At``); and how a descriptor that went stale is found.

On a shared mount whose entry caches have expired, the kernel resolves every component of a
path it is handed with a round trip to the metadata server; a key resolved relative to a
held descriptor of the root costs its own components only (docs/protocol.md §5).
"""

from __future__ import annotations

import os
import stat
import threading
import time
import weakref

#: how long a check that the held root is the directory at the root's path holds (``stale``)
PATH_CHECK_S = 1.0
#: a descriptor that only names a directory (no open sent to the filesystem); 0 elsewhere
O_PATH = getattr(os, "O_PATH", 0)


class At:
    """Where a call's keys are resolved: relative to the held root descriptor ``fd``, or
    (no descriptor: the root does not exist yet, or cannot be opened) as absolute paths."""

    __slots__ = ("fd", "_root")

    def __init__(self, fd: int | None, root: str) -> None:
        self.fd = fd
        self._root = root

    def p(self, key: str) -> str:
        """``key`` ('' for the root itself) as the path to hand the kernel with ``fd``."""
        if self.fd is not None:
            return key or "."
        return os.path.join(self._root, key) if key else self._root


class HeldDirs:
    """The descriptors (``O_PATH``) a handle holds: its root's (key ''), opened at the first
    call, and those of directories it renames within, opened relative to the root's; all
    closed when the handle goes."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._retired: list[int] = []
        self._lock = threading.Lock()
        #: when the held root was last found to be the directory at the path (monotonic)
        self._path_checked = float("-inf")
        weakref.finalize(self, _close_all, self._fds, self._retired)

    def root_at(self) -> At:
        return At(self.held(""), self.root)

    def held(self, key: str) -> int | None:
        """The descriptor of directory ``key`` ('' the root), opened now if not held; None
        if it cannot be opened (the caller goes by path, which reports why)."""
        with self._lock:
            return self._held(key)

    def _held(self, key: str) -> int | None:
        fd = self._fds.get(key)
        if fd is not None:
            return fd
        flags = O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            if not key:
                fd = os.open(self.root, flags)
            else:
                root = self._held("")
                if root is None:
                    return None
                fd = os.open(key, flags, dir_fd=root)
        except OSError:
            return None
        self._fds[key] = fd
        return fd

    def stale(self, key: str = "", *, answer: bool = False) -> bool:
        """After a call through held descriptors failed: whether the root's (and, for a
        ``key``, that directory's) is no longer the directory at its path: removed (a
        removed directory keeps its inode, with no links, until its last descriptor goes),
        replaced by another of its name, or on a mount that went away. Such descriptors
        are dropped (every one, when it is the root's: they were opened through it), so
        the next call opens the path again. A dropped descriptor stays open until the
        handle goes: another thread may be using it now, and a closed number could be
        reused by an unrelated file. ``answer``: the call failed with ENOENT, which is most
        often the answer itself (a name not there), so the path is compared at most once
        per ``PATH_CHECK_S``; any other errno (ENOTCONN, ESTALE, EBADF, EIO: a descriptor
        of a mount that went away may still ``fstat`` from the attribute cache) compares
        it every time."""
        with self._lock:
            root = self._fds.get("")
            if root is None:
                return False
            if not self._root_is_the_path(root, answer):
                self._retired.extend(self._fds.values())
                self._fds.clear()
                return True
            fd = self._fds.get(key) if key else None
            if fd is None or same(fd, root, key):
                return False
            self._retired.append(self._fds.pop(key))
            return True

    def _root_is_the_path(self, root: int, answer: bool) -> bool:
        """Whether the held root is still the directory at the root's path. A removed root
        (its last link gone: a run deleted, perhaps made again) is seen by ``fstat`` of the
        descriptor alone, every time; the comparison with the path — a ``stat`` that walks
        every component from the mount root, the cost the descriptor saves — runs at most
        once per ``PATH_CHECK_S`` after an ``answer`` (most failing calls are a name not
        there; a root replaced while it stays linked, moved away whole, which strawq never
        does, is caught within that time), and after any other failure every time."""
        try:
            if os.fstat(root).st_nlink == 0:
                return False
        except OSError:
            return False
        now = time.monotonic()
        if answer and now - self._path_checked < PATH_CHECK_S:
            return True
        if not same(root, None, self.root):
            return False
        self._path_checked = now
        return True


def same(fd: int, dir_fd: int | None, path: str) -> bool:
    """Whether descriptor ``fd`` is the directory at ``path`` (relative to ``dir_fd``)."""
    try:
        held, now = os.fstat(fd), os.stat(path, dir_fd=dir_fd)
    except OSError:
        return False
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _close_all(fds: dict[str, int], retired: list[int]) -> None:
    for fd in [*fds.values(), *retired]:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    retired.clear()


def read_at(at: At, key: str, size: int) -> bytes:
    """The content of ``key`` (at most ``size`` bytes; -1: all)."""
    fd = os.open(at.p(key), os.O_RDONLY | os.O_CLOEXEC, dir_fd=at.fd)
    with os.fdopen(fd, "rb") as f:
        return f.read(size)


def list_at(at: At, directory: str) -> list[str]:
    """The names in ``directory``, opened relative to ``at`` (an ``O_PATH`` descriptor
    cannot be read)."""
    fd = os.open(at.p(directory), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=at.fd)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def lexists(at: At, key: str) -> bool:
    try:
        os.stat(at.p(key), dir_fd=at.fd, follow_symlinks=False)
    except (OSError, ValueError):
        return False
    return True


def isdir(at: At, key: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(at.p(key), dir_fd=at.fd).st_mode)
    except (OSError, ValueError):
        return False
