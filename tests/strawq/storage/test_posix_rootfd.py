"""``PosixStorage`` names keys relative to a descriptor of its run root (docs/protocol.md §5,
"Every call relative to a held descriptor of the run root"): on a shared mount with no
entry cache the kernel resolves every component of a path it is handed, each a round trip
to the metadata server, so the root's own components are resolved once per handle, not per
call. A descriptor that went stale (the run removed and made again at its path, replaced,
the mount gone) is found out by the call that fails through it, which is made again at the
path."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import strawq.storage.held as held_mod
import strawq.storage.posix as posix_mod
from strawq.errors import NotFound
from strawq.storage import PosixStorage
from strawq.testing.factories import make_group
from tests.strawq.queue_helpers import make_feeder, make_queue

#: ``os`` functions of the store that hand the kernel a path: (positions of the path
#: arguments, the keyword of the descriptor each is relative to)
_PATH_CALLS = {"open": ((0,), ("dir_fd",)), "stat": ((0,), ("dir_fd",)),
               "unlink": ((0,), ("dir_fd",)), "mkdir": ((0,), ("dir_fd",)),
               "rmdir": ((0,), ("dir_fd",)),
               "rename": ((0, 1), ("src_dir_fd", "dst_dir_fd"))}


class KernelPaths:
    """Stands for ``os`` inside ``strawq.storage.posix`` and ``.held`` and records each path
    the store hands the kernel, with whether it was relative to a descriptor (``renameat2``
    too)."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str, bool]] = []  # (call, path, relative to a descriptor)

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in _PATH_CALLS:
            return real
        positions, fds = _PATH_CALLS[name]

        def recorded(*a: Any, **kw: Any) -> Any:
            for pos, fd in zip(positions, fds, strict=True):
                if isinstance(a[pos], str):
                    self.paths.append((name, a[pos], kw.get(fd) is not None))
            return real(*a, **kw)
        return recorded

    def record_renameat2(self, real: Any) -> Any:
        def recorded(sfd: int, src: bytes, dfd: int, dst: bytes, flags: int) -> int:
            self.paths.append(("renameat2", os.fsdecode(src), sfd != posix_mod._AT_FDCWD))
            self.paths.append(("renameat2", os.fsdecode(dst), dfd != posix_mod._AT_FDCWD))
            return int(real(sfd, src, dfd, dst, flags))
        return recorded

    def components(self) -> int:
        """Path components the kernel resolved: an absolute path's from the filesystem's
        root, a relative one's from its descriptor."""
        return sum(len([c for c in p.split("/") if c and c != "."]) for _, p, _ in self.paths)

    def take(self) -> list[tuple[str, str, bool]]:
        out, self.paths = self.paths, []
        return out


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> KernelPaths:
    rec = KernelPaths()
    monkeypatch.setattr(posix_mod, "os", rec)
    monkeypatch.setattr(held_mod, "os", rec)
    real = posix_mod._renameat2
    assert real is not None
    monkeypatch.setattr(posix_mod, "_renameat2", rec.record_renameat2(real))
    return rec


def test_a_claim_a_complete_and_a_listing_name_only_their_keys(tmp_path: Path,
                                                                kernel: KernelPaths) -> None:
    """No call of a claim, a complete or a listing hands the kernel the run's path: each
    names its key relative to the held root (before: every call an absolute path, the
    run's components walked again each time, here 1 + the depth of ``tmp_path``)."""
    deep = tmp_path / "a" / "b" / "c" / "d" / "run"
    st = PosixStorage(str(deep))
    q = make_queue(st)
    make_feeder(q, tmp_path, 4).release(4)
    (first,) = q.claim("p0")  # the first claim and complete list, cache and read the
    q.complete(first, make_group(first.task_id))  # run format: the next are the steady ones
    kernel.take()

    (lease,) = q.claim("p0")
    claim = kernel.take()
    q.complete(lease, make_group(lease.task_id))
    complete = kernel.take()
    assert len(st.list("ready")) == 2
    listing = kernel.take()

    for what, seen in (("claim", claim), ("complete", complete), ("listing", listing)):
        assert seen, what
        absolute = [p for p in seen if not p[2]]
        assert not absolute, f"{what} handed the kernel absolute paths: {absolute}"
        assert all(not p[1].startswith("/") for p in seen), (what, seen)
    # every path is a key of at most three components ('pending/r-…/name', 'leased/name')
    per_call = max(len(p[1].split("/")) for p in claim + complete + listing)
    assert per_call <= 3, claim + complete + listing
    kernel.paths = listing
    assert kernel.components() == 1  # 'ready', opened relative to the root, then read


def test_a_run_removed_and_made_again_is_written_by_a_handle_opened_before(
        tmp_path: Path) -> None:
    """An existing handle follows the path, as it did when every call walked it: the held
    descriptor is of a removed directory (no names, creates refused), the call that fails
    there finds the descriptor stale and is made again at the path, in the new run."""
    root = tmp_path / "run"
    st = PosixStorage(str(root))
    st.publish("a/k", b"old")
    assert st.read("a/k") == b"old"
    shutil.rmtree(root)
    other = PosixStorage(str(root))
    other.publish("a/k", b"new")
    assert st.read("a/k") == b"new"  # not NotFound from the removed directory
    st.publish("b/k", b"written by the old handle")
    assert (root / "b" / "k").read_bytes() == b"written by the old handle"
    assert st.list("a") == ["k"] and st.exists("b/k")
    shutil.rmtree(root)
    assert st.list("a") == [] and not st.exists("a/k")  # gone: no stale answer either
    st.publish("c/k", b"the run made again by a publish")
    assert (root / "c" / "k").read_bytes() == b"the run made again by a publish"


def test_a_root_renamed_away_and_replaced_is_found_by_the_failing_call_and_retried(
        tmp_path: Path, kernel: KernelPaths) -> None:
    """The root renamed away (the held descriptor follows it) and another directory put at
    its path: a call that fails in the old one (its name is only in the new) checks the
    descriptor against the path, drops it and is made again there, once."""
    root = tmp_path / "run"
    root.mkdir()
    st = PosixStorage(str(root))
    st.publish("q/src", b"x")  # opens the root's descriptor
    os.rename(root, tmp_path / "run.old")
    (root / "q").mkdir(parents=True)
    (root / "q" / "only-new").write_bytes(b"new")
    kernel.take()
    st.rename("q/only-new", "q/moved", sync_dir=False)
    seen = kernel.take()
    assert (root / "q" / "moved").read_bytes() == b"new"
    renames = [p for p in seen if p[0] == "renameat2"]
    assert len(renames) == 4, seen  # the attempt in the old directory, then the retry
    # by path only the check, and the new root's open
    assert [p for p in seen if not p[2]] == [("stat", str(root), False),
                                             ("open", str(root), False)], seen
    # the new descriptor is used from now on: the old run is left alone
    st.publish("q/after", b"y")
    assert (root / "q" / "after").exists() and not (tmp_path / "run.old" / "q" / "after").exists()
    with pytest.raises(NotFound):
        st.read("q/src")  # the old run's name is not in the run at the path


def test_an_answer_that_is_no_is_checked_against_the_path(tmp_path: Path) -> None:
    """``NotFound`` from a live held root is the answer (no retry: the descriptor is still
    the directory at the path); the check costs a stat of the path only then."""
    st = PosixStorage(str(tmp_path / "run"))
    st.publish("a/k", b"x")
    fd = st._dirs.held("")
    with pytest.raises(NotFound):
        st.read("a/missing")
    assert st._dirs.held("") == fd  # kept
    assert not st.exists("a/missing") and st.list("nothing") == []


def test_a_stale_descriptor_error_other_than_enoent_is_retried_for_reads_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO may come after a request took effect: a read is made again at the path, a
    rename is reported (the first attempt may have happened); ENOTCONN (the request was
    never sent) is retried for both."""
    st = PosixStorage(str(tmp_path / "run"))
    st.publish("a/k", b"x")
    st.publish("a/s", b"y")
    held = st._dirs.held("")
    assert held is not None
    real_open, real_renameat2 = os.open, posix_mod._renameat2
    assert real_renameat2 is not None
    fail: dict[str, int] = {}

    def flaky_open(path: Any, flags: int, *a: Any, dir_fd: int | None = None, **kw: Any) -> int:
        code = fail.pop("open", 0) if dir_fd == held else 0
        if code:
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *a, dir_fd=dir_fd, **kw)

    def flaky_renameat2(sfd: int, src: bytes, dfd: int, dst: bytes, flags: int) -> int:
        code = fail.pop("rename", 0) if sfd == held else 0
        if code:
            posix_mod.ctypes.set_errno(code)
            return -1
        return int(real_renameat2(sfd, src, dfd, dst, flags))

    monkeypatch.setattr(posix_mod, "_renameat2", flaky_renameat2)
    # the held descriptor stale: the run renamed away and copied back at its path
    os.rename(tmp_path / "run", tmp_path / "run.old")
    shutil.copytree(tmp_path / "run.old", tmp_path / "run")
    monkeypatch.setattr(os, "open", flaky_open)
    fail["open"] = errno.EIO
    assert st.read("a/k") == b"x"  # retried at the path
    held = st._dirs.held("")  # the new root's
    os.rename(tmp_path / "run", tmp_path / "run.2")
    shutil.copytree(tmp_path / "run.2", tmp_path / "run")
    fail["rename"] = errno.EIO
    with pytest.raises(OSError) as info:
        st.rename("a/s", "a/t", sync_dir=False)
    assert info.value.errno == errno.EIO
    held = st._dirs.held("")
    fail["rename"] = errno.ENOTCONN
    os.rename(tmp_path / "run", tmp_path / "run.3")
    shutil.copytree(tmp_path / "run.3", tmp_path / "run")
    st.rename("a/s", "a/t", sync_dir=False)
    assert (tmp_path / "run" / "a" / "t").exists() and (tmp_path / "run.3" / "a" / "s").exists()


@pytest.mark.process
def test_a_forked_child_uses_the_inherited_descriptor(tmp_path: Path) -> None:
    """A producer may be a forked process: it inherits the held descriptor (``O_PATH``: no
    offset or lock to share) and writes through it."""
    st = PosixStorage(str(tmp_path / "run"))
    st.publish("a/parent", b"p")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            st.publish("a/child", b"c")
            os._exit(0 if st.read("a/parent") == b"p" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert st.read("a/child") == b"c"


def test_names_not_there_walk_the_run_path_at_most_once_a_second(
        tmp_path: Path, kernel: KernelPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    """Most failing calls are answers (a control record not published yet, a lost claim
    race): each checks the held root with ``fstat`` (a removed root has no links), and
    compares it with the path — a walk of every component from the filesystem's root, the
    cost the descriptor saves — at most once per ``PATH_CHECK_S`` (before: at every one)."""
    st = PosixStorage(str(tmp_path / "run"))
    st.publish("control/k", b"x")
    clock = [1000.0]
    monkeypatch.setattr(held_mod.time, "monotonic", lambda: clock[0])
    assert st.exists("control/k")  # the root's descriptor is open
    kernel.take()
    for _ in range(20):
        assert not st.exists("control/pause-000000000007")
    absolute = [p for p in kernel.take() if not p[2]]
    assert len(absolute) == 1, absolute  # one walk of the run's path for 20 answers
    clock[0] += held_mod.PATH_CHECK_S
    assert not st.exists("control/pause-000000000007")
    assert len([p for p in kernel.take() if not p[2]]) == 1  # checked again after a second
    # a root removed and made again is still found at once: its descriptor has no links
    shutil.rmtree(tmp_path / "run")
    PosixStorage(str(tmp_path / "run")).publish("control/k", b"y")
    assert st.read("control/k") == b"y"
