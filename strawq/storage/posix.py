"""POSIX backend: a local directory, or a JuiceFS / NFS mount.

Writes follow the maildir discipline (``docs/filesystem-contract.md``): unique
temporary name in ``tmp/`` on the same filesystem, fsync, close, rename into place without
replacing, fsync the directory. The file is never published while its descriptor is open
(JuiceFS shows such a file empty to other clients).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence

from strawq.errors import AlreadyExists, NotFound, StorageError, StorageFull
from strawq.liveness import pid_alive
from strawq.storage.base import Capabilities, Storage, validate_key

log = logging.getLogger(__name__)

#: Modes of what a run creates, before the process umask: never any bit for others; the
#: group gets what the umask leaves it (umask 022/027: ``rwxr-x---`` / ``rw-r-----``;
#: umask 007 for a run shared by a group of users: ``rwxrwx---`` / ``rw-rw----``).
#: ``docs/security.md``.
DIR_MODE = 0o770
FILE_MODE = 0o660

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
#: a descriptor that only names a directory (no open sent to the filesystem); 0 elsewhere
_O_PATH = getattr(os, "O_PATH", 0)

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = getattr(_libc, "renameat2", None)
except OSError:  # pragma: no cover - non-glibc platforms
    _renameat2 = None


def translate(exc: OSError, what: str) -> Exception:
    """Map an ``OSError`` to the package's exceptions, keeping errno and the message."""
    code = exc.errno
    msg = f"{what}: {exc.strerror or exc}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(code, msg + " (free space or raise the quota; nothing was published)")
    if code == errno.ENOENT:
        return NotFound(code, msg)
    if code in (errno.EEXIST, errno.ENOTEMPTY):
        return AlreadyExists(code, msg)
    return StorageError(code if code is not None else errno.EIO, msg)


class PosixStorage(Storage):
    """A store rooted at a directory of a POSIX filesystem."""

    def __init__(self, root: str, *, writer_id: str | None = None, fsync: bool = True,
                 tmp_dir: str = "tmp", nfs_retry_rule: bool = False,
                 read_only: bool = False) -> None:
        self.root = os.path.abspath(root)
        #: refuse every write, and skip the tidying a listing may do (``rmdir`` of a drained
        #: release directory): what ``strawq status`` and ``strawq inspect`` open
        self.read_only = read_only
        self.writer_id = writer_id or f"w{os.getpid()}"
        self._fsync = fsync
        self._tmp = tmp_dir
        self._noreplace_ok = _renameat2 is not None
        # NFS only: a retried RENAME whose first attempt succeeded reports ENOENT. Off by
        # default: elsewhere ENOENT with the destination present means another mover won.
        self._nfs_retry_rule = nfs_retry_rule
        self.capabilities = Capabilities(durable=fsync)
        # ``tmp/`` is made by the first publish, not here: opening a store to read it
        # (``strawq status``, a trainer's reader) must not write to the directory.
        # Temporary names say which process wrote them (``<writer>.<host>-<pid>.<uuid>``),
        # so a dead writer's leftovers are found without the operator naming it.
        self._tmp_tag = f"{self.writer_id}.{_host()}-{os.getpid()}"
        #: directories held open for ``rename_within``
        self._dirs = _HeldDirs()

    # -- paths ---------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, validate_key(key))

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    def describe(self) -> str:
        return f"posix:{self.root}"

    # -- primitives ----------------------------------------------------------------------
    def _fsync_dir(self, path: str) -> None:
        if not self._fsync:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise translate(exc, f"open directory {path} for fsync") from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            # EINVAL: the filesystem cannot fsync directories; nothing more to do there.
            if exc.errno != errno.EINVAL:
                raise translate(exc, f"fsync directory {path}") from exc
        finally:
            os.close(fd)

    def _rename_noreplace(self, src: str, dst: str) -> None:
        if self._noreplace_ok and _renameat2 is not None:
            rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                            _RENAME_NOREPLACE)
            if rc == 0:
                return
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                log.warning("RENAME_NOREPLACE unsupported under %s; using rename()", self.root)
                self._noreplace_ok = False
            else:
                raise OSError(code, os.strerror(code), src)
        # Fallback: destinations are unique by construction, so a check is enough to catch
        # bugs; the atomicity that matters (one winner per source) is rename's own.
        if os.path.lexists(dst):
            raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StorageError(errno.EROFS, f"{what}: this store was opened read-only "
                                            f"({self.root}); nothing was written")

    def publish(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                sync_dir: bool = True, sync_file: bool = True, in_place: bool = False) -> None:
        self._writable(f"publish {key}")
        dst = self._path(key)
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        sync = self._fsync and sync_file
        if in_place:
            # No temporary name: the directory is private until it is renamed into place
            # (``Storage.publish``). Saves the temporary file's create and the rename, and
            # their lookups, per record.
            try:
                fd = _create_exclusive(dst)
            except OSError as exc:
                raise translate(exc, f"publish {key}") from exc
            try:
                self._fill(fd, dst, chunks, sync)
            except OSError as exc:
                _unlink_quietly(dst)  # ours: the exclusive create made it
                raise translate(exc, f"publish {key}") from exc
        else:
            tmp = os.path.join(self.root, self._tmp, f"{self._tmp_tag}.{uuid.uuid4().hex}")
            try:
                fd = _create_exclusive(tmp)  # the first write to this run makes tmp/
            except OSError as exc:
                raise translate(exc, f"create temporary file for {key}") from exc
            try:
                self._fill(fd, tmp, chunks, sync)
                try:
                    self._rename_noreplace(tmp, dst)
                except FileNotFoundError:
                    # The parent directory is missing: create it once and retry.
                    make_dirs(os.path.dirname(dst))
                    self._rename_noreplace(tmp, dst)
            except OSError as exc:
                _unlink_quietly(tmp)
                raise translate(exc, f"publish {key}") from exc
        if sync_dir and sync_file:
            self._fsync_dir(os.path.dirname(dst))

    def _fill(self, fd: int, path: str, chunks: Sequence[bytes | bytearray | memoryview],
              sync: bool) -> None:
        """Write ``chunks`` to the new file ``fd`` (at ``path``), fsync it if ``sync``, and
        close it: a file is never given its name, or its directory renamed, while open."""
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except OSError as exc:
            raise translate(exc, f"read {key}") from exc

    def read_prefix(self, key: str, size: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(size)
        except OSError as exc:
            raise translate(exc, f"read {key}") from exc

    def size(self, key: str) -> int:
        try:
            return os.stat(self._path(key)).st_size
        except OSError as exc:
            raise translate(exc, f"stat {key}") from exc

    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        self._writable(f"rename {src} -> {dst}")
        s, d = self._path(src), self._path(dst)
        try:
            try:
                self._rename_noreplace(s, d)
            except FileNotFoundError:
                # Like publish: a missing destination directory is created, never reported
                # as NotFound (which every caller reads as "somebody else won the source").
                if not os.path.lexists(s) or os.path.isdir(os.path.dirname(d)):
                    raise
                make_dirs(os.path.dirname(d))
                self._rename_noreplace(s, d)
        except OSError as exc:
            # NFS: a retried RENAME whose first attempt succeeded reports ENOENT. Our
            # destinations are unique to the caller, so an existing one means we won.
            if (self._nfs_retry_rule and exc.errno == errno.ENOENT and os.path.lexists(d)
                    and not os.path.lexists(s)):
                log.debug("rename %s -> %s reported ENOENT but the destination exists", src, dst)
            else:
                raise translate(exc, f"rename {src} -> {dst}") from exc
        if sync_dir:
            self._fsync_dir(os.path.dirname(d))
            if os.path.dirname(s) != os.path.dirname(d):
                self._fsync_dir(os.path.dirname(s))

    def rename_within(self, directory: str, src: str, dst: str) -> None:
        """``renameat2`` of two names relative to a descriptor of ``directory`` held by this
        handle: the kernel looks up the two names only, not every component of the path
        again (on a shared mount with short or no entry caches, each is a round trip to
        the metadata server: a heartbeat's rename by path cost two walks of it). Anything
        but success falls back to ``rename`` by path, which decides and reports: a gone
        directory (removed, or replaced by another of its name) is then found again, and
        the NFS retry rule applies. A directory moved away whole (the protocol never moves
        ``hb/``) keeps the renames of a handle that holds it."""
        if "/" in src or "/" in dst:
            raise ValueError(f"rename_within {directory}: {src!r} and {dst!r} must be names "
                             f"inside it, not paths")
        self._writable(f"rename {directory}/{src} -> {directory}/{dst}")
        validate_key(f"{directory}/{src}")
        validate_key(f"{directory}/{dst}")
        fd = self._dirs.held(self._path(directory)) if self._noreplace_ok else None
        if fd is not None and _renameat2 is not None:
            if _renameat2(fd, os.fsencode(src), fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
                return
            self._dirs.recheck(self._path(directory))
        self.rename(f"{directory}/{src}", f"{directory}/{dst}", sync_dir=False)

    def list(self, directory: str) -> list[str]:
        path = self._path(directory) if directory else self.root
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise translate(exc, f"list {directory}") from exc
        return sorted(n for n in names if not n.startswith("."))

    def delete(self, key: str, *, missing_ok: bool = True) -> None:
        self._writable(f"delete {key}")
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            if not missing_ok:
                raise NotFound(errno.ENOENT, f"delete {key}: no such key") from None
        except OSError as exc:
            raise translate(exc, f"delete {key}") from exc

    def rmdir(self, directory: str) -> bool:
        if self.read_only:
            return False  # only ever tidying: a reader leaves it to the next writer
        try:
            os.rmdir(self._path(directory))
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return False
            raise translate(exc, f"rmdir {directory}") from exc
        return True

    def exists(self, key: str) -> bool:
        return os.path.lexists(self._path(key))

    def is_dir(self, key: str) -> bool:
        return os.path.isdir(self._path(key))

    def makedirs(self, directory: str) -> None:
        self._writable(f"makedirs {directory}")
        path = self._path(directory)
        try:
            make_dirs(path)
        except OSError as exc:
            raise translate(exc, f"makedirs {directory}") from exc
        self._fsync_dir(os.path.dirname(path))

    def sync_dirs(self, directories: Iterable[str]) -> None:
        for d in dict.fromkeys(directories):
            self._fsync_dir(self._path(d) if d else self.root)

    def clean_tmp(self, writer_prefix: str) -> int:
        """Remove temporary files of writers whose ids start with ``writer_prefix``.

        Only call this for writers known to be gone (a fenced collector epoch, a producer
        whose lease the grantor expired): a live writer's temporary file is in use.
        """
        n = 0
        for name in self.list(self._tmp):
            if name.startswith(writer_prefix + "."):
                _unlink_quietly(os.path.join(self.root, self._tmp, name))
                n += 1
        return n

    def clean_dead_tmp(self, *, grace_s: float = 3600.0) -> int:
        """Remove temporary files whose writers are dead, without being told who they were.

        A file written on this host by a process that no longer exists is removed at once
        (its name carries host and pid). Any other file is removed once it is older than
        ``grace_s`` by its mtime: a publish holds its temporary file for the time of one
        write, so an hour-old one is abandoned whatever the clock skew between hosts
        (the one place mtimes are trusted, and only to an hour's width). The mtime of a
        file written from another host can be that host's clock (JuiceFS clients stamp
        their own time), so a grace under ``MIN_TMP_GRACE_S`` is refused (``ValueError``):
        it could take a file still being written on a host whose clock runs behind.
        """
        if not grace_s >= MIN_TMP_GRACE_S:
            raise ValueError(tmp_grace_problem(grace_s))
        host, now, n = _host(), time.time(), 0
        for name in self.list(self._tmp):
            path = os.path.join(self.root, self._tmp, name)
            if name.startswith(self._tmp_tag + "."):
                continue  # our own, possibly in flight in another thread
            dead = False
            parts = name.split(".")
            if len(parts) >= 3:
                h, _, pid = parts[-2].rpartition("-")
                dead = h == host and pid.isascii() and pid.isdigit() and not pid_alive(int(pid))
            if not dead:
                try:
                    dead = now - os.stat(path).st_mtime >= grace_s
                except OSError:
                    continue
            if dead:
                _unlink_quietly(path)
                n += 1
        return n


class _HeldDirs:
    """Descriptors (``O_PATH``) of directories a handle renames within, opened at first use
    and closed when the handle goes."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._retired: list[int] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds, self._retired)

    def held(self, path: str) -> int | None:
        """The descriptor of ``path``, opened now if not held; None if it cannot be opened
        (the caller falls back to paths, which report why)."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError:
                    return None
                self._fds[path] = fd
            return fd

    def recheck(self, path: str) -> None:
        """After a failed call: drop the descriptor if ``path`` is no longer the directory it
        holds (removed, or replaced by another of its name), so the next call opens it
        again. A dropped descriptor stays open until the handle goes: another thread may be
        using it now, and a closed number could be reused by an unrelated file."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                return
            try:
                held, now = os.fstat(fd), os.stat(path)
                same = (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
            except OSError:
                same = False
            if not same:
                self._retired.append(self._fds.pop(path))


def _close_all(fds: dict[str, int], retired: list[int]) -> None:
    for fd in [*fds.values(), *retired]:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    retired.clear()


#: The least age (by mtime) at which a temporary file of another host is judged abandoned:
#: a clock skew between hosts of up to 10 minutes, plus a slow write.
MIN_TMP_GRACE_S = 900.0


def tmp_grace_problem(grace_s: float) -> str:
    """Why ``grace_s`` is refused as the temporary-file grace (one line, with what to do)."""
    return (f"the temporary-file grace must be at least {MIN_TMP_GRACE_S:.0f} s, got "
            f"{grace_s!r}: a file's mtime may be its writer's clock, and a writer whose "
            "clock runs 10 minutes behind makes a file it is still writing look 10 minutes "
            f"old; pass {MIN_TMP_GRACE_S:.0f} or more (the default is 3600), or --tmp-of "
            "WRITER for a writer known dead")


def make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` with ``DIR_MODE`` for every level it creates."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if parent == os.path.abspath(path):
            raise
        make_dirs(parent)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(path):
                raise


def _create_exclusive(path: str) -> int:
    """``open(path, O_CREAT | O_EXCL)`` for writing; a missing parent is made once."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags, FILE_MODE)
    except FileNotFoundError:
        make_dirs(os.path.dirname(path))
        return os.open(path, flags, FILE_MODE)


def _host() -> str:
    """This host's name as a temporary-name component (no dots or odd characters)."""
    h = socket.gethostname().split(".")[0]
    return "".join(c if c.isalnum() or c in "_+=" else "_" for c in h)[:40] or "host"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
