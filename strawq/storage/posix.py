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
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from strawq.errors import AlreadyExists, NotFound, StorageError, StorageFull, StrawqError
from strawq.liveness import pid_alive
from strawq.storage.base import Capabilities, Storage, parent, validate_key
from strawq.storage.held import At, HeldDirs, isdir, lexists, list_at, read_at

log = logging.getLogger(__name__)

#: Modes of what a run creates, before the process umask: never any bit for others; the
#: group gets what the umask leaves it (umask 022/027: ``rwxr-x---`` / ``rw-r-----``;
#: umask 007 for a run shared by a group of users: ``rwxrwx---`` / ``rw-rw----``).
#: ``docs/security.md``.
DIR_MODE = 0o770
FILE_MODE = 0o660

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
#: errnos after which a call relative to the held root is made again at the path, if the
#: descriptor is no longer the root's directory: the first attempt cannot have happened
#: (``PosixStorage._attempt``)
_RETRY = frozenset({errno.ENOENT, errno.ENOTCONN, errno.ESTALE, errno.EBADF})
#: the same for calls that change nothing: EIO too
_RETRY_READS = _RETRY | {errno.EIO}

_T = TypeVar("_T")

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
    """A store rooted at a directory of a POSIX filesystem.

    Every call names its key relative to a descriptor of the root that the handle holds
    (``dir_fd=``, ``renameat2``), so the kernel resolves the key's own components only,
    never the root's path again: on a shared mount whose entry caches have expired, each
    component is a round trip to the metadata server. The handle is bound to the *path*
    all the same: a call that fails in a way a stale descriptor explains is checked
    against the path and, if the descriptor no longer is the directory there, made again
    once (``strawq.storage.held``). A forked child inherits the descriptors (``O_PATH``: no
    offset, no lock to share; each process checks and replaces its own)."""

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
        self.capabilities = Capabilities(durable=fsync, append=True)
        # ``tmp/`` is made by the first publish, not here: opening a store to read it
        # (``strawq status``, a trainer's reader) must not write to the directory.
        # Temporary names say which process wrote them (``<writer>.<host>-<pid>.<uuid>``),
        # so a dead writer's leftovers are found without the operator naming it.
        self._tmp_tag = f"{self.writer_id}.{_host()}-{os.getpid()}"
        #: the root's descriptor, and those of directories renamed within (``rename_within``)
        self._dirs = HeldDirs(self.root)
        #: files ``append`` holds open between appends (a journal segment: each window's
        #: append is a write and an fsync, no lookup or open), closed by ``end_append``
        self._appending: dict[str, int] = {}
        self._append_lock = threading.Lock()

    # -- paths ---------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, validate_key(key))

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    def describe(self) -> str:
        return f"posix:{self.root}"

    # -- the held root ---------------------------------------------------------------------
    def _at(self, op: Callable[[At], _T], *, reads: bool = False) -> _T:
        """``op``'s result (``_attempt``)."""
        return self._attempt(op, reads=reads)[0]

    def _attempt(self, op: Callable[[At], _T], *, reads: bool = False) -> tuple[_T, At]:
        """``op`` relative to the held root; once more if it failed as a stale root fails.

        The retry is safe for every call: it happens only on an errno that says the first
        attempt did nothing (ENOENT: the name, or a directory on the way, was not there —
        a removed root holds nothing and refuses creates, so no call acts there; ENOTCONN:
        the FUSE connection was gone before the request was sent, an in-flight one gets
        ECONNABORTED instead; ESTALE: the server did not know the handle; EBADF), and only
        when the held descriptor is no longer the directory at the root's path. EIO may
        come after the request took effect, so only reads are retried on it. A call whose
        steps all succeeded is never made again, whatever follows (a directory fsync after
        a rename raises the package's errors, which are not retried)."""
        at = self._dirs.root_at()
        try:
            return op(at), at
        except StrawqError:
            raise
        except OSError as exc:
            retry = _RETRY_READS if reads else _RETRY
            if (at.fd is None or exc.errno not in retry
                    or not self._dirs.stale(answer=exc.errno == errno.ENOENT)):
                raise
        at = self._dirs.root_at()
        return op(at), at

    # -- primitives ----------------------------------------------------------------------
    def _fsync_dir(self, at: At, directory: str) -> None:
        """fsync ``directory`` (a key, or '' for the root), opened relative to ``at``."""
        if not self._fsync:
            return
        try:
            fd = os.open(at.p(directory), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                         dir_fd=at.fd)
        except OSError as exc:
            raise translate(exc, f"open directory {self._shown(directory)} for fsync") from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            # EINVAL: the filesystem cannot fsync directories; nothing more to do there.
            if exc.errno != errno.EINVAL:
                raise translate(exc, f"fsync directory {self._shown(directory)}") from exc
        finally:
            os.close(fd)

    def _shown(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def _rename_noreplace(self, at: At, src: str, dst: str) -> None:
        """Rename key ``src`` to key ``dst`` (relative to ``at``) without replacing."""
        s, d = at.p(src), at.p(dst)
        if self._noreplace_ok and _renameat2 is not None:
            fd = _AT_FDCWD if at.fd is None else at.fd
            rc = _renameat2(fd, os.fsencode(s), fd, os.fsencode(d), _RENAME_NOREPLACE)
            if rc == 0:
                return
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                log.warning("RENAME_NOREPLACE unsupported under %s; using rename()", self.root)
                self._noreplace_ok = False
            else:
                raise OSError(code, os.strerror(code), s)
        # Fallback: destinations are unique by construction, so a check is enough to catch
        # bugs; the atomicity that matters (one winner per source) is rename's own.
        if lexists(at, dst):
            raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), d)
        os.rename(s, d, src_dir_fd=at.fd, dst_dir_fd=at.fd)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StorageError(errno.EROFS, f"{what}: this store was opened read-only "
                                            f"({self.root}); nothing was written")

    def publish(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview], *,
                sync_dir: bool = True, sync_file: bool = True, in_place: bool = False) -> None:
        self._writable(f"publish {key}")
        validate_key(key)
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        sync = self._fsync and sync_file
        write = self._write_in_place if in_place else self._write_and_rename
        try:
            _, at = self._attempt(lambda a: write(a, key, chunks, sync))
        except StrawqError:
            raise
        except OSError as exc:
            raise translate(exc, f"publish {key}") from exc
        if sync_dir and sync_file:
            # the directory the file was renamed into, through the same descriptor
            self._fsync_dir(at, parent(key))

    def _write_in_place(self, at: At, key: str, chunks: Sequence[bytes | memoryview],
                        sync: bool) -> None:
        # No temporary name: the directory is private until it is renamed into place
        # (``Storage.publish``). Saves the temporary file's create and the rename, and
        # their lookups, per record.
        fd = _create_exclusive(at, key)
        try:
            self._fill(fd, key, chunks, sync)
        except OSError:
            _unlink_quietly(at, key)  # ours: the exclusive create made it
            raise

    def _write_and_rename(self, at: At, key: str, chunks: Sequence[bytes | memoryview],
                          sync: bool) -> None:
        tmp = f"{self._tmp}/{self._tmp_tag}.{uuid.uuid4().hex}"
        fd = _create_exclusive(at, tmp)  # the first write to this run makes tmp/
        try:
            self._fill(fd, tmp, chunks, sync)
            try:
                self._rename_noreplace(at, tmp, key)
            except FileNotFoundError:
                # The parent directory is missing: create it once and retry.
                make_dirs(at.p(parent(key)), dir_fd=at.fd)
                self._rename_noreplace(at, tmp, key)
        except OSError:
            _unlink_quietly(at, tmp)
            raise

    def _fill(self, fd: int, key: str, chunks: Sequence[bytes | bytearray | memoryview],
              sync: bool) -> None:
        """Write ``chunks`` to the new file ``fd`` (at ``key``), fsync it if ``sync``, and
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

    def append(self, key: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
        self._writable(f"append {key}")
        validate_key(key)
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        with self._append_lock:
            fd = self._appending.pop(key, None)
            try:
                if fd is None:
                    fd = self._at(lambda at: os.open(at.p(key), os.O_WRONLY | os.O_APPEND
                                                     | os.O_CLOEXEC, dir_fd=at.fd))
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                if self._fsync:
                    os.fsync(fd)
            except OSError as exc:
                if fd is not None:
                    os.close(fd)  # the writer appends to this file no more (a torn tail)
                raise translate(exc, f"append {key}") from exc
            self._appending[key] = fd

    def end_append(self, key: str) -> None:
        with self._append_lock:
            fd = self._appending.pop(key, None)
        if fd is not None:
            os.close(fd)

    def read(self, key: str) -> bytes:
        validate_key(key)
        try:
            return self._at(lambda at: read_at(at, key, -1), reads=True)
        except OSError as exc:
            raise translate(exc, f"read {key}") from exc

    def read_prefix(self, key: str, size: int) -> bytes:
        validate_key(key)
        try:
            return self._at(lambda at: read_at(at, key, size), reads=True)
        except OSError as exc:
            raise translate(exc, f"read {key}") from exc

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        validate_key(key)

        def pread(at: At) -> bytes:
            fd = os.open(at.p(key), os.O_RDONLY | os.O_CLOEXEC, dir_fd=at.fd)
            try:
                out: list[bytes] = []
                got = 0
                while got < size:
                    b = os.pread(fd, size - got, offset + got)
                    if not b:
                        break
                    out.append(b)
                    got += len(b)
                return b"".join(out)
            finally:
                os.close(fd)

        try:
            return self._at(pread, reads=True)
        except OSError as exc:
            raise translate(exc, f"read {key}") from exc

    def size(self, key: str) -> int:
        validate_key(key)
        try:
            return self._at(lambda at: os.stat(at.p(key), dir_fd=at.fd).st_size, reads=True)
        except OSError as exc:
            raise translate(exc, f"stat {key}") from exc

    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        self._writable(f"rename {src} -> {dst}")
        validate_key(src)
        validate_key(dst)
        try:
            _, at = self._attempt(lambda a: self._rename_at(a, src, dst))
        except OSError as exc:
            raise translate(exc, f"rename {src} -> {dst}") from exc
        if sync_dir:
            self._fsync_dir(at, parent(dst))
            if parent(src) != parent(dst):
                self._fsync_dir(at, parent(src))

    def _rename_at(self, at: At, src: str, dst: str) -> None:
        try:
            try:
                self._rename_noreplace(at, src, dst)
            except FileNotFoundError:
                # Like publish: a missing destination directory is created, never reported
                # as NotFound (which every caller reads as "somebody else won the source").
                if not lexists(at, src) or isdir(at, parent(dst)):
                    raise
                make_dirs(at.p(parent(dst)), dir_fd=at.fd)
                self._rename_noreplace(at, src, dst)
        except OSError as exc:
            # NFS: a retried RENAME whose first attempt succeeded reports ENOENT. Our
            # destinations are unique to the caller, so an existing one means we won.
            if (self._nfs_retry_rule and exc.errno == errno.ENOENT and lexists(at, dst)
                    and not lexists(at, src)):
                log.debug("rename %s -> %s reported ENOENT but the destination exists", src, dst)
            else:
                raise

    def rename_within(self, directory: str, src: str, dst: str) -> None:
        """``renameat2`` of two names relative to a descriptor of ``directory`` held by this
        handle (opened relative to the root's): the kernel looks up the two names only (a
        heartbeat). Anything but success falls back to ``rename``, which decides and
        reports; before it, a descriptor that is no longer the directory at its key (the
        directory, or the root, removed or replaced) is dropped, to be opened again at
        the next call. A directory moved away whole (the protocol never moves ``hb/``)
        keeps the renames of a handle that holds it until one fails there."""
        if "/" in src or "/" in dst:
            raise ValueError(f"rename_within {directory}: {src!r} and {dst!r} must be names "
                             f"inside it, not paths")
        self._writable(f"rename {directory}/{src} -> {directory}/{dst}")
        validate_key(f"{directory}/{src}")
        validate_key(f"{directory}/{dst}")
        fd = self._dirs.held(directory) if self._noreplace_ok else None
        if fd is not None and _renameat2 is not None:
            if _renameat2(fd, os.fsencode(src), fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
                return
            self._dirs.stale(directory, answer=ctypes.get_errno() == errno.ENOENT)
        self.rename(f"{directory}/{src}", f"{directory}/{dst}", sync_dir=False)

    def list(self, directory: str) -> list[str]:
        if directory:
            validate_key(directory)
        try:
            names = self._at(lambda at: list_at(at, directory), reads=True)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise translate(exc, f"list {directory}") from exc
        return sorted(n for n in names if not n.startswith("."))

    def delete(self, key: str, *, missing_ok: bool = True) -> None:
        self._writable(f"delete {key}")
        validate_key(key)
        if self._appending:
            self.end_append(key)
        try:
            self._at(lambda at: os.unlink(at.p(key), dir_fd=at.fd))
        except FileNotFoundError:
            if not missing_ok:
                raise NotFound(errno.ENOENT, f"delete {key}: no such key") from None
        except OSError as exc:
            raise translate(exc, f"delete {key}") from exc

    def rmdir(self, directory: str) -> bool:
        if self.read_only:
            return False  # only ever tidying: a reader leaves it to the next writer
        validate_key(directory)
        try:
            self._at(lambda at: os.rmdir(at.p(directory), dir_fd=at.fd))
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return False
            raise translate(exc, f"rmdir {directory}") from exc
        return True

    def exists(self, key: str) -> bool:
        validate_key(key)
        try:
            self._at(lambda at: os.stat(at.p(key), dir_fd=at.fd, follow_symlinks=False),
                     reads=True)
        except (OSError, ValueError):
            return False
        return True

    def is_dir(self, key: str) -> bool:
        validate_key(key)
        try:
            st = self._at(lambda at: os.stat(at.p(key), dir_fd=at.fd), reads=True)
        except (OSError, ValueError):
            return False
        return stat.S_ISDIR(st.st_mode)

    def makedirs(self, directory: str) -> None:
        self._writable(f"makedirs {directory}")
        validate_key(directory)
        try:
            _, at = self._attempt(lambda a: make_dirs(a.p(directory), dir_fd=a.fd))
        except OSError as exc:
            raise translate(exc, f"makedirs {directory}") from exc
        self._fsync_dir(at, parent(directory))

    def sync_dirs(self, directories: Iterable[str]) -> None:
        at = self._dirs.root_at()
        for d in dict.fromkeys(directories):
            if d:
                validate_key(d)
            try:
                self._fsync_dir(at, d)
            except OSError as exc:
                if (at.fd is None or exc.errno not in _RETRY_READS
                        or not self._dirs.stale(answer=exc.errno == errno.ENOENT)):
                    raise
                at = self._dirs.root_at()  # an fsync may be made twice: again, at the path
                self._fsync_dir(at, d)

    def clean_tmp(self, writer_prefix: str) -> int:
        """Remove temporary files of writers whose ids start with ``writer_prefix``.

        Only call this for writers known to be gone (a fenced collector epoch, a producer
        whose lease the grantor expired): a live writer's temporary file is in use.
        """
        n = 0
        at = self._dirs.root_at()
        for name in self.list(self._tmp):
            if name.startswith(writer_prefix + "."):
                _unlink_quietly(at, f"{self._tmp}/{name}")
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
        at = self._dirs.root_at()
        for name in self.list(self._tmp):
            key = f"{self._tmp}/{name}"
            if name.startswith(self._tmp_tag + "."):
                continue  # our own, possibly in flight in another thread
            dead = False
            parts = name.split(".")
            if len(parts) >= 3:
                h, _, pid = parts[-2].rpartition("-")
                dead = h == host and pid.isascii() and pid.isdigit() and not pid_alive(int(pid))
            if not dead:
                try:
                    dead = now - os.stat(at.p(key), dir_fd=at.fd).st_mtime >= grace_s
                except OSError:
                    continue
            if dead:
                _unlink_quietly(at, key)
                n += 1
        return n


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


def make_dirs(path: str, *, dir_fd: int | None = None) -> None:
    """``os.makedirs(path, exist_ok=True)`` with ``DIR_MODE`` for every level it creates;
    with ``dir_fd``, ``path`` is relative to that directory, which is not created."""
    try:
        os.mkdir(path, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        if not isdir(At(dir_fd, ""), path):
            raise
    except FileNotFoundError:
        if dir_fd is None:
            up = os.path.dirname(os.path.abspath(path))
            if up == os.path.abspath(path):
                raise
        else:
            up = os.path.dirname(path)
            if not up or up == ".":
                raise  # the directory the path is relative to is gone
        make_dirs(up, dir_fd=dir_fd)
        try:
            os.mkdir(path, DIR_MODE, dir_fd=dir_fd)
        except FileExistsError:
            if not isdir(At(dir_fd, ""), path):
                raise


def _create_exclusive(at: At, key: str) -> int:
    """``open(key, O_CREAT | O_EXCL)`` for writing; a missing parent is made once."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(at.p(key), flags, FILE_MODE, dir_fd=at.fd)
    except FileNotFoundError:
        make_dirs(at.p(parent(key)), dir_fd=at.fd)
        return os.open(at.p(key), flags, FILE_MODE, dir_fd=at.fd)


def _host() -> str:
    """This host's name as a temporary-name component (no dots or odd characters)."""
    h = socket.gethostname().split(".")[0]
    return "".join(c if c.isalnum() or c in "_+=" else "_" for c in h)[:40] or "host"


def _unlink_quietly(at: At, key: str) -> None:
    try:
        os.unlink(at.p(key), dir_fd=at.fd)
    except OSError:
        pass
