"""The in-flight journal's records (``strawq.tasks.journal``): the prefix a lease resumes
from, a corrupt record's fallback, the crash points of a window and of a park, the bound
on its size and its garbage."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from strawq.producers.group import GroupRun
from strawq.producers.handback import HandBack
from strawq.producers.held import GroupTable
from strawq.producers.journal_flush import load_prefix
from strawq.producers.sample import SamplerParams
from strawq.storage import MemoryStorage, PosixStorage
from strawq.tasks import journal
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.journal import load_chain, record_keys, sweep_journal
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.testing import make_group
from strawq.testing.faults import CrashPoint, FaultyStorage
from tests.producers.journal_helpers import flusher, generate, hold, run_with_tasks, stream
from tests.strawq.queue_helpers import FakeClock, clobber


def _params(i: int) -> SamplerParams:
    return SamplerParams(max_new_tokens=10_000)


def _expire(q: RunQueue) -> None:
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    mon.scan()
    clock.advance(60)
    mon.scan()


def _lens(q: RunQueue, producer: str) -> list[int] | None:
    (lease,) = q.claim(producer)
    group = load_prefix(q, lease, _params)
    return None if group is None else list(group.sample_lens)


def test_a_corrupt_record_is_quarantined_and_the_prefix_falls_back(tmp_path: Path) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=False)
    run = a.run
    assert run is not None

    async def go() -> None:
        io.start()
        for n in (5, 3, 2):  # a full entry, then two deltas
            generate(run.samples[0], n)
            await j.flush()
        io.shutdown()

    asyncio.run(go())
    oldest_first = list(reversed(record_keys(storage, "p1")))
    assert len(oldest_first) == 3
    chain = load_chain(storage, "p1", a.lease.task_id, a.lease.gen)
    assert chain is not None and [e["full"] for e in chain] == [True, False, False]
    clobber(storage, oldest_first[1], b"SQRC torn")  # the middle delta
    chain = load_chain(storage, "p1", a.lease.task_id, a.lease.gen,
                       quarantine=q.quarantine)
    assert chain is not None and len(chain) == 1  # the newer delta built on it: dropped too
    assert any("journal" in k for k in storage.list("quarantine"))
    _expire(q)
    assert _lens(q, "p2") == [5, 0]


def test_the_newest_full_entry_bounds_what_a_writer_keeps(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(journal, "FULL_EVERY", 4)
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=False)
    run = a.run
    assert run is not None
    held = []

    async def go() -> None:
        io.start()
        for _ in range(20):
            generate(run.samples[0], 2)
            await j.flush()
            held.append(len(record_keys(storage, "p1")))
        io.shutdown()

    asyncio.run(go())
    assert max(held) == 4  # not 20: the windows before a full one are deleted
    _expire(q)
    assert _lens(q, "p2") == [40, 0]


@pytest.mark.parametrize("crash_at", [1, 2, 3, 4])
def test_a_crash_at_each_step_of_a_park_leaves_a_durable_prefix(tmp_path: Path,
                                                               crash_at: int) -> None:
    """A window is durable (5 tokens); the park then writes one record of full entries (8
    tokens), deletes the window it supersedes and renames the lease. Killed before the
    record: the next holder resumes 5 tokens; before the delete or the rename: 8 (the
    lease expires); after: 8, from the queued name."""
    inner = MemoryStorage()
    run_with_tasks(inner, tmp_path, 1)
    faulty = FaultyStorage(inner)
    q = RunQueue(faulty)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, book = flusher(q, table, "p1")
    hb = HandBack(q, io, book)
    hb.journal = j
    run = a.run
    assert run is not None

    async def window() -> None:
        io.start()
        generate(run.samples[0], 5)
        await j.flush()

    async def park() -> None:
        stream(run.samples[0], 3)
        a.parking = True
        await hb.yield_partial(a.lease, run.to_group(producer="p1", version_hint=0,
                                                     partial=True))
        io.shutdown()

    async def both() -> None:
        await window()
        faulty._crash_after = faulty.mutations + crash_at
        await park()

    crashed = False
    try:
        asyncio.run(both())
    except CrashPoint:
        crashed = True
    faulty._crash_after = None
    q2 = RunQueue(inner)
    if crashed:
        assert names_in(inner, TaskState.LEASED)  # still held: the grantor expires it
        _expire(q2)
    want = {1: [5, 0], 2: [8, 0], 3: [8, 0], 4: [8, 0]}[crash_at]
    assert crashed == (crash_at < 4)
    assert _lens(q2, "p2") == want


def test_gc_keeps_what_a_live_task_resumes_from_and_sweeps_the_rest(tmp_path: Path) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1")
    run = a.run
    assert run is not None

    async def go() -> None:
        io.start()
        generate(run.samples[0], 4)
        await j.flush()
        io.shutdown()

    asyncio.run(go())
    assert sweep_journal(storage) == 0  # the holder's own lease
    _expire(q)  # p1 is gone: its entries are the resume point now
    assert sweep_journal(storage) == 0
    (lease,) = q.claim("p2")
    group = load_prefix(q, lease, _params)
    assert group is not None
    assert sweep_journal(storage) == 0  # p2 holds it and may not have journaled yet
    resumed = GroupRun.from_partial(lease, group, _params)
    q.complete(lease, make_group(lease.task_id, 0, lens=tuple(
        s.response_length + 1 for s in resumed.samples)))
    assert sweep_journal(storage) == 1
    assert storage.list("journal") == []


def test_gc_and_the_grantor_read_only_the_records_metadata(tmp_path: Path) -> None:
    """The columns lie in the payload: deciding which leases a record holds reads a prefix
    of it (gc every pass, the grantor at each expiry), never the tokens."""
    storage = PosixStorage(str(tmp_path / "run"))
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=False)
    run = a.run
    assert run is not None

    async def go() -> None:
        io.start()
        generate(run.samples[0], 4000)
        await j.flush()
        io.shutdown()

    asyncio.run(go())
    whole = storage.read
    read: list[str] = []

    def counting(key: str) -> bytes:
        read.append(key)
        return whole(key)

    storage.read = counting  # type: ignore[method-assign]
    assert journal.journaled(storage, "p1") == {(a.lease.task_id, a.lease.gen): 0}
    assert sweep_journal(storage) == 0
    assert not [k for k in read if k.startswith("journal/")]
