"""Leases: expiry on the grantor's clock, generations that fence an old holder, heartbeats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from strawq.errors import LeaseLost
from strawq.ondisk.names import data_key
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.testing import audit_run, make_group
from strawq.testing.factories import make_partial
from tests.strawq.queue_helpers import FakeClock, make_feeder, make_queue, tid


def test_expiry_bumps_generation_and_fences_the_old_holder(storage: Storage,
                                                           tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    old, other = q.claim("slow", 2)
    assert mon.scan().expired == []
    clock.advance(9.9)
    assert mon.scan().expired == []
    clock.advance(0.2)
    res = mon.scan()
    assert sorted(res.expired) == [tid(0), tid(1)] and res.leases == 2
    state, name = q.find(tid(0))
    assert (state, name.gen, name.attempts, name.producer) == ("pending", 1, 1, None)
    ready_before = storage.list("ready")
    with pytest.raises(LeaseLost, match="no longer held"):
        q.complete(old, make_group(tid(0), marker=1.0))
    assert storage.list("ready") == ready_before == []
    assert not storage.exists(data_key(tid(0), 0, "group")), "fenced payload left behind"
    for op in (lambda: q.yield_partial(other, make_partial(tid(1))),
               lambda: q.release(other), lambda: q.drop(other, "x")):
        with pytest.raises(LeaseLost):
            op()
    assert not storage.exists(data_key(tid(1), 0, "partial"))
    assert not q.still_held(old)
    new = q.claim("fast", 2)
    assert sorted((lease.task_id, lease.gen) for lease in new) == [(tid(0), 1), (tid(1), 1)]
    for lease in new:
        q.complete(lease, make_group(lease.task_id, marker=2.0))
    audit = audit_run(storage)
    assert audit.check([tid(0), tid(1)]) == []
    assert audit.ids("ready") == {tid(0), tid(1)}
    assert q.read_group(tid(0), 1).rewards == [2.0, 2.0]


@pytest.mark.parametrize("backend", [
    "memory",
    "posix",
])
def test_fenced_fail_raises_lease_lost(backend: str, tmp_path: Path) -> None:
    storage = MemoryStorage() if backend == "memory" else PosixStorage(str(tmp_path / "run"))
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    (lease,) = q.claim("p")
    mon.scan()
    clock.advance(11)
    assert mon.scan().expired == [tid(0)]
    with pytest.raises(LeaseLost):
        q.fail(lease, "engine_error", "reported after the lease expired")
    assert q.find(tid(0))[1].gen == 1


class _PausedComplete(PosixStorage):
    """Runs ``before_rename`` inside the next complete, between its payload (written in
    place, durable) and its fencing rename out of ``leased/``."""

    before_rename: Any = None

    def _rename_noreplace(self, at: Any, src: str, dst: str) -> None:
        hook, self.before_rename = self.before_rename, None
        if hook is not None and src.startswith("leased/"):
            hook()
        super()._rename_noreplace(at, src, dst)


def test_holder_expired_mid_publish_gets_lease_lost(tmp_path: Path) -> None:
    storage = _PausedComplete(str(tmp_path / "run"), writer_id="p")
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    (lease,) = q.claim("p")
    mon.scan()

    def grantor_expires_now() -> None:
        clock.advance(11)
        assert mon.scan().expired == [tid(0)]

    storage.before_rename = grantor_expires_now
    with pytest.raises(LeaseLost):
        q.complete(lease, make_group(tid(0)))
    assert q.find(tid(0))[1].gen == 1 and storage.list("ready") == []
    assert storage.list("data") == []  # the fenced holder's payload is removed


def test_heartbeats_keep_leases_alive_on_the_grantors_clock(storage: Storage,
                                                            tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    (alive,) = q.claim("alive")
    (silent,) = q.claim("silent")
    assert q.heartbeat("alive") == 1
    mon.scan()
    expired = []
    for _ in range(5):
        clock.advance(6)
        q.heartbeat("alive")
        res = mon.scan()
        expired += res.expired
    assert expired == [silent.task_id]
    assert res.producers["alive"] == 6 and res.silence["alive"] == 0
    assert q.still_held(alive)
    clock.advance(10)
    assert mon.scan().expired == [alive.task_id]
    assert storage.list("hb") == [f"alive~{6:016d}"], "old heartbeat files must be deleted"


def test_heartbeat_counter_continues_after_restart(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    for _ in range(3):
        q.heartbeat("p")
    q2 = RunQueue.open(storage)
    assert q2.heartbeat("p") == 4
    # a producer that died between publishing a new counter and deleting the old one
    storage.publish(f"hb/p~{9:016d}", b"")
    mon = LeaseMonitor(q2, clock=FakeClock())
    assert mon.scan().producers == {"p": 9}
    assert storage.list("hb") == [f"p~{9:016d}"]


def test_expiry_at_max_attempts_drops_with_a_record(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=2)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    for expected in ("expired", "dropped"):
        q.claim("p")
        mon.scan()
        clock.advance(11)
        res = mon.scan()
        assert getattr(res, expected) == [tid(0)]
    state, name = q.find(tid(0))
    assert (state, name.producer, name.attempts) == ("dropped", "lease_expired.max_attempts", 2)
    assert audit_run(storage).check([tid(0)]) == []


def test_departed_producers_heartbeat_files_are_removed(storage: Storage,
                                                        tmp_path: Path) -> None:
    """hb/ stays proportional to live producers: a producer silent for two lease timeouts
    that holds no lease is forgotten; one still holding a lease is kept (its lease expires)."""
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    q.heartbeat("gone")
    q.heartbeat("holder")
    (lease,) = q.claim("holder")
    mon.scan()
    clock.advance(2 * q.config.lease_timeout_s + 1)
    res = mon.scan()
    assert res.expired == [lease.task_id]  # the holder's lease expired this scan
    assert storage.list("hb") == ["holder~0000000000000001"]
    clock.advance(2 * q.config.lease_timeout_s + 1)
    mon.scan()  # now it holds nothing either
    assert storage.list("hb") == []
    assert q.heartbeat("gone") == 2  # a paused one that wakes up carries on (same handle)
    assert mon.observe_heartbeats(clock()) == {"gone": 2}
