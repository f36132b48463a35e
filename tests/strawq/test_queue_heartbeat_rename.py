"""A heartbeat after the first is one rename of the counter's name (no create, no unlink),
within ``hb/``: on a POSIX store, relative to a descriptor of ``hb/`` the store holds, so the
kernel looks up the two names only, not the run's whole path twice."""

from __future__ import annotations

from typing import Any

import pytest

import strawq.storage.posix as posix_mod
from strawq.config import QueueConfig
from strawq.ondisk.names import heartbeat_key
from strawq.storage import MemoryStorage, PosixStorage
from strawq.tasks.queue import RunQueue


class Counting:
    """Counts the storage calls a beat makes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in ("publish", "rename", "rename_within", "delete"):
            def counted(*a: Any, **kw: Any) -> Any:
                self.calls.append(name)
                return attr(*a, **kw)
            return counted
        return attr


@pytest.mark.parametrize("kind", ["posix", "memory"])
def test_beats_rename_the_counter(kind: str, tmp_path) -> None:
    base = PosixStorage(str(tmp_path / "run")) if kind == "posix" else MemoryStorage()
    RunQueue.create(base, QueueConfig(group_size=2))
    st = Counting(base)
    q = RunQueue(st, QueueConfig(group_size=2))  # type: ignore[arg-type]
    assert q.heartbeat("p0") == 1
    assert st.calls == ["publish"]
    st.calls.clear()
    assert [q.heartbeat("p0") for _ in range(3)] == [2, 3, 4]
    assert st.calls == ["rename_within"] * 3
    assert base.list("hb") == [heartbeat_key("p0", 4).split("/", 1)[1]]
    # the grantor forgot a departed producer: its next beat publishes anew
    base.delete(heartbeat_key("p0", 4))
    assert q.heartbeat("p0") == 5
    assert base.list("hb") == [heartbeat_key("p0", 5).split("/", 1)[1]]
    assert sorted(q.heartbeats()) == [("p0", 5)]


def test_a_steady_beat_names_two_files_relative_to_hb(tmp_path, monkeypatch) -> None:
    """Path components the kernel resolves per steady beat: a rename by path resolved every
    component of both paths (on a shared mount with no entry cache, a Lookup and a GetAttr
    each: 44 of a beat's Redis commands were 28 such); now the two names, against the held
    descriptor of ``hb/``."""
    calls: list[tuple[int, bytes, int, bytes]] = []
    real = posix_mod._renameat2
    assert real is not None

    def recorded(sfd: int, src: bytes, dfd: int, dst: bytes, flags: int) -> int:
        calls.append((sfd, src, dfd, dst))
        return int(real(sfd, src, dfd, dst, flags))

    monkeypatch.setattr(posix_mod, "_renameat2", recorded)
    st = PosixStorage(str(tmp_path / "run"))
    q = RunQueue.create(st, QueueConfig(group_size=2))
    q.heartbeat("p0")
    calls.clear()
    assert [q.heartbeat("p0") for _ in range(3)] == [2, 3, 4]
    assert len(calls) == 3, calls
    resolved = sum(len(c[1].split(b"/")) + len(c[3].split(b"/")) for c in calls)
    assert resolved == 2 * 3, calls  # two names a beat, no directory
    assert {c[0] for c in calls} == {c[2] for c in calls} != {posix_mod._AT_FDCWD}
    assert st.list("hb") == [heartbeat_key("p0", 4).split("/", 1)[1]]


def test_beats_follow_hb_replaced_under_the_held_descriptor(tmp_path) -> None:
    """The held descriptor names the directory that was ``hb/``; if another directory takes
    the name (a run directory restored from a copy), beats go to the new one, and a beat
    whose file is gone there publishes anew as before."""
    st = PosixStorage(str(tmp_path / "run"))
    q = RunQueue.create(st, QueueConfig(group_size=2))
    assert [q.heartbeat("p0") for _ in range(2)] == [1, 2]
    hb = tmp_path / "run" / "hb"
    hb.rename(tmp_path / "hb.old")
    hb.mkdir()
    (tmp_path / "hb.old" / heartbeat_key("p0", 2).split("/", 1)[1]).rename(
        hb / heartbeat_key("p0", 2).split("/", 1)[1])
    assert q.heartbeat("p0") == 3
    assert st.list("hb") == [heartbeat_key("p0", 3).split("/", 1)[1]]
    assert list((tmp_path / "hb.old").iterdir()) == []
    (hb / heartbeat_key("p0", 3).split("/", 1)[1]).unlink()
    assert q.heartbeat("p0") == 4  # gone: published anew, in the directory named hb/
    assert st.list("hb") == [heartbeat_key("p0", 4).split("/", 1)[1]]
    assert q.heartbeat("p0") == 5
    assert st.list("hb") == [heartbeat_key("p0", 5).split("/", 1)[1]]
