"""The slot pool and the hand-back on their own: no engine, no producer loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from strawq.errors import StorageError
from strawq.storage.memory import MemoryStorage

from strawq.producers.handback import HandBack
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.offload import Offload
from strawq.producers.slots import SlotHold, SlotPool
from tests.producers.helpers import ids, make_run


def test_eager_claims_a_group_as_soon_as_one_trajectory_is_free() -> None:
    async def fill(pool: SlotPool, hold: SlotHold, demand: int, take: int) -> None:
        pool.set_demand(hold, demand)
        for _ in range(take):
            assert await pool.acquire(hold, lambda: False)

    async def main(eager: bool) -> list[int]:
        pool = SlotPool(2, 4, eager=eager)  # 8 trajectories
        seen = [pool.claimable_groups()]
        first, second = SlotHold(), SlotHold()
        await fill(pool, first, 4, 4)
        seen.append(pool.claimable_groups())  # 4 free
        await fill(pool, second, 4, 2)  # 2 samples still wait for a trajectory
        seen.append(pool.claimable_groups())  # 2 free, 2 demanded
        pool.release(first, 2)
        seen.append(pool.claimable_groups())  # 4 free, 2 demanded
        pool.release(first, 1)
        seen.append(pool.claimable_groups())  # 5 free, 2 demanded
        return seen

    assert asyncio.run(main(eager=True)) == [2, 1, 0, 1, 1]
    assert asyncio.run(main(eager=False)) == [2, 1, 0, 0, 0]


def test_acquire_waits_fifo_and_stops_when_halted() -> None:
    async def main() -> None:
        kicks: list[int] = []
        pool = SlotPool(1, 2, eager=True, kick=lambda: kicks.append(1))  # 2 trajectories
        a, b = SlotHold(), SlotHold()
        pool.set_demand(a, 2)
        pool.set_demand(b, 2)
        assert await pool.acquire(a, lambda: False) and await pool.acquire(a, lambda: False)
        assert pool.busy == 2 and pool.claimable_groups() == 0
        waiting = asyncio.create_task(pool.acquire(b, lambda: False))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        pool.release(a)  # frees one: the waiter gets it
        assert await asyncio.wait_for(waiting, 1.0) and b.reserved == 1 and kicks
        halted = False
        stopped = asyncio.create_task(pool.acquire(b, lambda: halted))
        halted = True
        pool.wake_all()
        assert await asyncio.wait_for(stopped, 1.0) is False
        assert pool.demand == 0  # demand is consumed either way
        pool.close(a)
        pool.close(b)
        assert pool.busy == 0 and pool.claimable_groups() == 1

    asyncio.run(main())


def test_set_slots_changes_capacity_without_preempting() -> None:
    pool = SlotPool(2, 4, eager=True)
    hold = SlotHold()

    async def main() -> None:
        pool.set_demand(hold, 4)
        for _ in range(4):
            assert await pool.acquire(hold, lambda: False)

    asyncio.run(main())
    pool.set_slots(0)
    assert pool.busy == 4 and pool.capacity == 0 and pool.claimable_groups() == 0
    pool.release(hold, 4)
    assert pool.busy == 0


def test_handback_counts_lease_lost_and_keeps_orphans_until_released(tmp_path: Path) -> None:
    q = make_run(str(tmp_path), 3, storage=MemoryStorage(writer_id="p"))
    book = StatsBook(ProducerStats())
    hb = HandBack(q, Offload(1, "t-io"), book)

    async def main() -> None:
        a, b, c = q.claim("p", 3)
        await hb.release(a)
        await hb.release(a)  # the lease is no longer ours: fenced off, counted
        assert book.get("groups_released") == 1 and book.get("leases_lost") == 1
        await hb.fail(b, "bad_task", "no prompt", retryable=False)
        assert book.get("groups_failed") == 1

        real = q.release
        calls: list[Any] = []

        def broken(lease: Any) -> None:
            calls.append(lease)
            if len(calls) == 1:
                raise StorageError(5, "injected: release failed")
            real(lease)

        q.release = broken  # type: ignore[method-assign]
        await hb.release(c)
        assert hb.orphans == [c] and book.get("groups_released") == 1
        await hb.retry_orphans()
        assert hb.orphans == [] and book.get("groups_released") == 2

    asyncio.run(main())
    assert ids(q, "pending") == ["i000000000000", "i000000000002"] and not ids(q, "leased")


@pytest.mark.parametrize("reason", ["zero_variance"])
def test_handback_drop_counts_its_reason(tmp_path: Path, reason: str) -> None:
    q = make_run(str(tmp_path), 1, storage=MemoryStorage(writer_id="p"))
    book = StatsBook(ProducerStats())
    hb = HandBack(q, Offload(1, "t-io"), book)

    async def main() -> None:
        (lease,) = q.claim("p", 1)
        await hb.drop(lease, reason, f"filter: {reason}")

    asyncio.run(main())
    s = book.snapshot()
    assert s.groups_dropped == 1 and s.drop_reasons == {reason: 1}
    assert len(ids(q, "dropped")) == 1
