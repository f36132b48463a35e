"""A heartbeat after the first is one rename of the counter's name (no create, no unlink)."""

from __future__ import annotations

from typing import Any

import pytest

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
        if name in ("publish", "rename", "delete"):
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
    assert st.calls == ["rename"] * 3
    assert base.list("hb") == [heartbeat_key("p0", 4).split("/", 1)[1]]
    # the grantor forgot a departed producer: its next beat publishes anew
    base.delete(heartbeat_key("p0", 4))
    assert q.heartbeat("p0") == 5
    assert base.list("hb") == [heartbeat_key("p0", 5).split("/", 1)[1]]
    assert sorted(q.heartbeats()) == [("p0", 5)]
