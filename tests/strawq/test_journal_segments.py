"""The in-flight journal's segments (``strawq.tasks.journal``): a window appended to the
writer's open segment as one frame; a torn tail read up to, a damaged middle frame
quarantined, a crash mid-append resumed from, record files still read beside segments,
superseded segments deleted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from strawq.producers.handback import HandBack
from strawq.producers.held import GroupTable
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.journal_flush import JournalFlush, load_prefix
from strawq.producers.sample import SamplerParams
from strawq.storage import Capabilities, MemoryStorage, PosixStorage, Storage
from strawq.tasks import journal
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.journal import (
    JournalLog,
    is_segment,
    load_chain,
    record_keys,
    sweep_journal,
    unframe,
)
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.testing.faults import CrashPoint, FaultyStorage
from tests.producers.journal_helpers import flusher, generate, hold, run_with_tasks
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


def _windows(j: JournalFlush, samples: list[object], io: object, sizes: tuple[int, ...]
             ) -> None:
    async def go() -> None:
        j.io.start()
        for n in sizes:
            for s in samples:
                generate(s, n)  # type: ignore[arg-type]
            assert await j.flush()
        j.io.shutdown()

    asyncio.run(go())


def _one_writer(storage: Storage, tmp_path: Path, sizes: tuple[int, ...], *,
                segments: bool | None = True) -> tuple[RunQueue, JournalFlush, tuple[str, int]]:
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=segments)
    assert a.run is not None
    _windows(j, [a.run.samples[0]], io, sizes)
    return q, j, (a.lease.task_id, a.lease.gen)


@pytest.mark.parametrize("backend", ["memory", "posix"])
def test_windows_are_frames_appended_to_one_segment(tmp_path: Path, backend: str) -> None:
    storage: Storage = (MemoryStorage() if backend == "memory"
                        else PosixStorage(str(tmp_path / "run")))
    q, j, (task, gen) = _one_writer(storage, tmp_path, (5, 3, 2))
    (key,) = record_keys(storage, "p1")  # one file for three windows
    assert is_segment(key)
    assert j.log is not None and j.log.stats.segments == 1 and j.log.stats.appends == 2
    bodies, torn = unframe(storage.read(key), key)
    assert len(bodies) == 3 and torn == 0
    chain = load_chain(storage, "p1", task, gen)
    assert chain is not None and [e["full"] for e in chain] == [True, False, False]
    _expire(q)
    assert _lens(q, "p2") == [10, 0]


def test_a_store_that_cannot_append_keeps_a_record_file_a_window(tmp_path: Path) -> None:
    storage = MemoryStorage()
    storage.capabilities = Capabilities(durable=False, multi_process=False, mmap=False)
    assert not storage.capabilities.append
    q, j, _ = _one_writer(storage, tmp_path, (5, 3, 2), segments=None)
    keys = record_keys(storage, "p1")
    assert len(keys) == 3 and not any(is_segment(k) for k in keys)
    _expire(q)
    assert _lens(q, "p2") == [10, 0]


def test_a_torn_tail_at_every_byte_of_the_last_frame_reads_the_prefix_before_it(
        tmp_path: Path) -> None:
    storage = MemoryStorage()
    q, _, (task, gen) = _one_writer(storage, tmp_path, (5, 3, 2))
    (key,) = record_keys(storage, "p1")
    whole = storage.read(key)
    bodies, _ = unframe(whole, key)
    last = len(whole) - len(bodies[-1]) - journal.FRAME.size  # where the last frame starts
    for cut in range(last, len(whole)):
        clobber(storage, key, whole[:cut])
        chain = load_chain(storage, "p1", task, gen, quarantine=q.quarantine)
        assert chain is not None and len(chain) == 2, cut  # the full entry and one delta
        assert sum(len(p["tokens"]) for e in chain for p in e["samples"]) == 4 * 8, cut
    # a size extended whose bytes never landed (zeros) is a torn tail too
    clobber(storage, key, whole[:last] + bytes(len(whole) - last))
    chain = load_chain(storage, "p1", task, gen, quarantine=q.quarantine)
    assert chain is not None and len(chain) == 2
    # the last frame's body damaged in place: a tail whose write did not finish
    clobber(storage, key, whole[:-1] + bytes([whole[-1] ^ 0xFF]))
    chain = load_chain(storage, "p1", task, gen, quarantine=q.quarantine)
    assert chain is not None and len(chain) == 2
    assert storage.list("quarantine") == [], "a torn tail is not corruption"
    assert storage.list("journal/p1") == [key.rpartition("/")[2]]


@pytest.mark.parametrize("where", ["body", "header"])
def test_a_damaged_frame_before_an_intact_one_is_quarantined(tmp_path: Path,
                                                            where: str) -> None:
    storage = MemoryStorage()
    q, _, (task, gen) = _one_writer(storage, tmp_path, (5, 3, 2))
    (key,) = record_keys(storage, "p1")
    whole = bytearray(storage.read(key))
    bodies, _ = unframe(bytes(whole), key)
    second = journal.FRAME.size + len(bodies[0])  # the first delta's frame
    at = second + (journal.FRAME.size + 10 if where == "body" else 6)
    whole[at] ^= 0xFF
    clobber(storage, key, bytes(whole))
    assert load_chain(storage, "p1", task, gen, quarantine=q.quarantine) is None
    assert any("journal" in k for k in storage.list("quarantine"))
    assert record_keys(storage, "p1") == []
    _expire(q)
    assert _lens(q, "p2") is None  # no prefix left: the task starts again from its prompt


@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_crash_mid_append_resumes_from_the_windows_before_it(tmp_path: Path,
                                                               crash_at: int) -> None:
    """Killed before the third window's append (1) or inside it, half its frame written
    (2): the next holder resumes from the first two windows (8 tokens)."""
    inner = MemoryStorage()
    run_with_tasks(inner, tmp_path, 1)
    faulty = FaultyStorage(inner)
    q = RunQueue(faulty)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=True)
    run = a.run
    assert run is not None
    _windows(j, [run.samples[0]], io, (5, 3))
    faulty._crash_after = faulty.mutations + crash_at
    generate(run.samples[0], 2)
    assert j.log is not None
    with pytest.raises(CrashPoint):
        j.log.append([j._entry(a, False)[0]])  # type: ignore[list-item]
    faulty._crash_after = None
    (key,) = record_keys(inner, "p1")
    assert len(unframe(inner.read(key), key)[0]) == 2
    assert (len(inner.read(key)) > sum(journal.FRAME.size + len(b) for b in
                                       unframe(inner.read(key), key)[0])) == (crash_at == 2)
    q2 = RunQueue(inner)
    assert names_in(inner, TaskState.LEASED)
    _expire(q2)
    assert _lens(q2, "p2") == [8, 0]
    assert inner.list("quarantine") == []


def test_after_a_failed_append_the_next_record_is_full_in_a_new_segment(
        tmp_path: Path) -> None:
    inner = MemoryStorage()
    q0 = run_with_tasks(inner, tmp_path, 1)
    faulty = FaultyStorage(inner, errors={"append": (2, 5)})  # the 2nd append: EIO
    q = RunQueue(faulty, q0.config)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=True)
    run = a.run
    assert run is not None

    async def go() -> None:
        io.start()
        for n, ok in ((5, True), (3, True), (2, False), (1, True)):
            generate(run.samples[0], n)
            assert await j.flush() is ok
        io.shutdown()

    asyncio.run(go())
    keys = record_keys(inner, "p1")
    assert len(keys) == 1, "the failed segment was superseded by the full record and deleted"
    chain = load_chain(inner, "p1", a.lease.task_id, a.lease.gen)
    assert chain is not None and [e["full"] for e in chain] == [True]
    _expire(q)
    assert _lens(RunQueue(inner), "p2") == [11, 0]


def test_record_files_of_an_older_incarnation_read_beside_segments(tmp_path: Path) -> None:
    """A run upgraded mid-flight: incarnation 1 wrote record files, incarnation 2 appends
    segments; each lease's prefix is found, whichever format holds it."""
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 2)
    table = GroupTable()
    a, b = hold(q, table, "p1", 2)
    assert a.run is not None and b.run is not None
    del table.groups[b.lease.key]
    old, io, _ = flusher(q, table, "p1", incarnation=1, segments=False)
    _windows(old, [a.run.samples[0]], io, (4, 2))
    del table.groups[a.lease.key]
    table.groups[b.lease.key] = b
    new, io2, _ = flusher(q, table, "p1", incarnation=2, segments=True)
    _windows(new, [b.run.samples[0]], io2, (7, 1))
    keys = record_keys(storage, "p1")
    assert [is_segment(k) for k in keys] == [True, False, False]  # newest first
    chain_a = load_chain(storage, "p1", a.lease.task_id, a.lease.gen)
    chain_b = load_chain(storage, "p1", b.lease.task_id, b.lease.gen)
    assert chain_a is not None and len(chain_a) == 2
    assert chain_b is not None and len(chain_b) == 2
    assert journal.journaled(storage, "p1") == {(a.lease.task_id, a.lease.gen): 0,
                                                (b.lease.task_id, b.lease.gen): 0}
    _expire(q)
    assert sorted([_lens(q, "p2"), _lens(q, "p3")]) == [[6, 0], [8, 0]]  # type: ignore[type-var]


def test_superseded_segments_are_deleted_and_gc_spares_a_live_writers_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal, "FULL_EVERY", 4)
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1", segments=True)
    run = a.run
    assert run is not None
    held: list[int] = []

    async def go() -> None:
        io.start()
        for _ in range(20):
            generate(run.samples[0], 2)
            assert await j.flush()
            held.append(len(record_keys(storage, "p1")))
        io.shutdown()

    asyncio.run(go())
    assert max(held) == 1  # a full record starts a segment and supersedes the one before
    assert j.log is not None and j.log.stats.segments == 5 and j.log.stats.deletes == 4

    # gc: a beating writer's newest segment is never swept (it may append to it a lease it
    # claims after the listings), an older one nobody needs is; a writer without a
    # heartbeat (departed) appends to none
    def segment(inc: int, task: str) -> None:
        JournalLog(storage, "p1", inc, segments=True).append(
            [{"task": task, "gen": 0, "full": True, "samples": []}], full=True)

    segment(9, "gone")
    segment(10, "gone2")
    q.heartbeat("p1")
    assert sweep_journal(storage) == 1  # incarnation 9's: nothing live needs "gone"
    assert len(record_keys(storage, "p1")) == 2  # the holder's own, and the newest
    for name in storage.list("hb"):
        storage.delete(f"hb/{name}")  # the grantor's "departed"
    assert sweep_journal(storage) == 1  # incarnation 10's too now
    assert len(record_keys(storage, "p1")) == 1  # the holder's own: its lease is live
    _expire(q)
    assert _lens(q, "p2") == [40, 0]


def test_a_writer_whose_leases_all_went_back_deletes_its_open_segment(tmp_path: Path
                                                                      ) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 3)
    table = GroupTable()
    g1, g2, g3 = hold(q, table, "p1", 3)
    del table.groups[g3.lease.key]
    j, io, _ = flusher(q, table, "p1", segments=True)
    hb = HandBack(q, io, StatsBook(ProducerStats(producer_id="p1")))
    hb.journal = j

    async def go() -> None:
        io.start()
        for a in (g1, g2):
            assert a.run is not None
            generate(a.run.samples[0], 4)
        assert await j.flush()
        await hb.release(g1.lease)
        assert len(record_keys(storage, "p1")) == 1  # g2's entry is still needed
        await hb.release(g2.lease)
        assert record_keys(storage, "p1") == []  # the open segment too
        table.groups[g3.lease.key] = g3
        assert g3.run is not None
        generate(g3.run.samples[0], 6)
        assert await j.flush()  # a new segment, its first record's entries all full
        io.shutdown()

    asyncio.run(go())
    (key,) = record_keys(storage, "p1")
    assert is_segment(key)
    chain = load_chain(storage, "p1", g3.lease.task_id, g3.lease.gen)
    assert chain is not None and [e["full"] for e in chain] == [True]

def test_gc_and_the_grantor_read_a_segments_metadata_not_its_columns(tmp_path: Path) -> None:
    """Which leases a segment holds is read frame by frame from each header and its
    record's first bytes (``read_range``), never the tokens nor the whole file; a torn
    tail is left out, at every cut of the last frame."""
    storage = PosixStorage(str(tmp_path / "run"))
    q = run_with_tasks(storage, tmp_path, 2)
    table = GroupTable()
    a, b = hold(q, table, "p1", 2)
    j, io, _ = flusher(q, table, "p1", segments=True)
    assert a.run is not None and b.run is not None
    _windows(j, [a.run.samples[0]], io, (3000, 3000, 3000))
    del table.groups[a.lease.key]
    j2, io2, _ = flusher(q, table, "p1", incarnation=2, segments=True)
    _windows(j2, [b.run.samples[0]], io2, (10,))  # a newer segment: gc may sweep the older
    whole, ranged = storage.read, storage.read_range
    read: list[str] = []
    got = [0]

    def counting(key: str) -> bytes:
        read.append(key)
        return whole(key)

    def counting_range(key: str, offset: int, size: int) -> bytes:
        out = ranged(key, offset, size)
        got[0] += len(out)
        return out

    storage.read = counting  # type: ignore[method-assign]
    storage.read_range = counting_range  # type: ignore[method-assign]
    ka, kb = (a.lease.task_id, a.lease.gen), (b.lease.task_id, b.lease.gen)
    assert journal.journaled(storage, "p1") == {ka: 0, kb: 0}
    assert sweep_journal(storage) == 0  # both leases are held
    assert not [k for k in read if k.startswith("journal/")]
    old = record_keys(storage, "p1")[1]
    # journaled: 1 + 3 frames, the sweep: the older segment's 3 (the newest is spared)
    assert got[0] <= 7 * (journal.FRAME.size + journal.META_PREFIX)
    assert got[0] < storage.size(old), "less than one whole segment, for two reads of both"
    storage.read = whole  # type: ignore[method-assign]
    data = whole(old)
    bodies, _ = unframe(data, old)
    last = len(data) - len(bodies[-1]) - journal.FRAME.size
    for cut in (last, last + 1, last + journal.FRAME.size, last + journal.FRAME.size + 50,
                len(data) - 1):
        clobber(storage, old, data[:cut])
        assert len(journal._segment_meta(storage, old)) == 2, cut



def test_a_new_incarnation_lets_go_of_the_previous_open_segment(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path / "run"))
    q, j, _ = _one_writer(storage, tmp_path, (5, 3))
    assert j.log is not None and j.log.open_segment is not None
    assert list(storage._appending) == record_keys(storage, "p1")  # held between appends
    j.open(2)
    assert storage._appending == {}
