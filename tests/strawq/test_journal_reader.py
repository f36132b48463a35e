"""Reading journal segments by offset (``strawq.tasks.journal.JournalReader``): a claim
reads only the frames its lease's prefix needs, a reader kept between claims reads a
growing segment again only from where it ended, and what it remembers never hides a
change (a torn tail completed, corruption after it, a segment gone)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from strawq.producers.group_load import GroupLoader
from strawq.producers.held import GroupTable
from strawq.producers.journal_flush import JournalFlush
from strawq.producers.offload import Offload
from strawq.producers.producer_config import EngineConfig, PluginsConfig, ProducerConfig
from strawq.storage import PosixStorage, Storage
from strawq.tasks import journal
from strawq.tasks.journal import JournalReader, load_chain, record_keys, unframe
from strawq.tasks.queue import RunQueue
from tests.producers.journal_helpers import (
    flusher,
    generate,
    hold,
    parking,
    run_with_tasks,
)
from tests.strawq.queue_helpers import clobber

#: bytes a scan reads of a frame it does not need: its header and its record's first bytes
HEAD = journal.FRAME.size + journal.META_PREFIX
G = 8


class Counted:
    """Counts the storage calls that read a journal file, and the bytes they return."""

    def __init__(self, storage: Storage) -> None:
        self.calls = 0
        self.bytes = 0
        for name in ("read", "read_prefix", "read_range", "size"):
            self._wrap(storage, name)

    def _wrap(self, storage: Storage, name: str) -> None:
        inner = getattr(storage, name)

        def counted(key: str, *args: Any) -> Any:
            out = inner(key, *args)
            if key.startswith("journal/"):
                self.calls += 1
                self.bytes += len(out) if isinstance(out, bytes) else 0
            return out

        setattr(storage, name, counted)

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.bytes)
        self.calls = self.bytes = 0
        return out


def _write(j: JournalFlush, windows: list[tuple[list[Any], int]]) -> None:
    """One record per window: ``n`` tokens more for each sample listed."""
    async def go() -> None:
        j.io.start()
        for samples, n in windows:
            for s in samples:
                generate(s, n)
            assert await j.flush()
        j.io.shutdown()

    asyncio.run(go())


def _two_leases(tmp_path: Path) -> tuple[PosixStorage, RunQueue, JournalFlush, Any, Any]:
    """One writer, one segment: a full entry of leases a and b (G = 8), then b alone grows
    by 1,500 tokens a sample a window for three windows (a's prefix is the first frame
    alone)."""
    storage = PosixStorage(str(tmp_path / "run"))
    q = run_with_tasks(storage, tmp_path, 2, group_size=G)
    table = GroupTable()
    a, b = hold(q, table, "p1", 2)
    j, _, _ = flusher(q, table, "p1", segments=True)
    _write(j, [([a.run.samples[0], *b.run.samples], 5)] + [(b.run.samples, 1500)] * 3)
    return storage, q, j, a, b


def test_a_claim_reads_only_the_frames_that_hold_its_lease(tmp_path: Path) -> None:
    """Lease a's prefix is the segment's first frame: the claim reads that frame and the
    other frames' headers, not b's 36,000 tokens (before: the whole segment)."""
    storage, _, _, a, b = _two_leases(tmp_path)
    (key,) = record_keys(storage, "p1")
    bodies, _ = unframe(storage.read(key), key)
    assert len(bodies) == 4
    size = storage.size(key)
    counted = Counted(storage)
    chain = load_chain(storage, "p1", a.lease.task_id, a.lease.gen)
    assert chain is not None and [e["full"] for e in chain] == [True]
    assert sum(len(p["tokens"]) for e in chain for p in e["samples"]) == 4 * 5
    calls, got = counted.take()
    assert got <= 4 * HEAD < size // 4, (got, size)
    assert calls <= 6  # its size and four headers (the first frame is read with its header)
    # b's prefix needs every frame: each is read once, the later three in one read_range
    chain = load_chain(storage, "p1", b.lease.task_id, b.lease.gen)
    assert chain is not None and [e["full"] for e in chain] == [True, False, False, False]
    assert sum(len(p["tokens"]) for e in chain for p in e["samples"]) == 4 * G * (5 + 4500)
    calls, got = counted.take()
    assert got <= size + 4 * HEAD and calls <= 7


def test_a_kept_reader_reads_a_growing_segment_only_from_where_it_ended(
        tmp_path: Path) -> None:
    """The next claim by the same reader reads what the segment grew by, and of that only
    the headers of frames that do not hold its lease; a frame it already read is not
    read again."""
    storage, _, j, a, b = _two_leases(tmp_path)
    (key,) = record_keys(storage, "p1")
    reader = JournalReader(storage)
    counted = Counted(storage)
    assert reader.chain("p1", a.lease.task_id, a.lease.gen) is not None
    before = storage.size(key)
    # the same writer incarnation appends three more windows of b to its open segment
    assert j.log is not None and j.log.open_segment is not None
    j.io = Offload(1, "p1-io-2")
    _write(j, [(b.run.samples, 1500)] * 3)
    assert record_keys(storage, "p1") == [key]
    grown = storage.size(key) - before
    counted.take()
    chain = reader.chain("p1", a.lease.task_id, a.lease.gen)
    assert chain is not None and [e["full"] for e in chain] == [True]
    calls, got = counted.take()
    assert got <= 3 * HEAD < grown // 4, (got, grown)
    assert calls <= 5  # the listing is not a file read: its size and three headers
    # nothing new: no frame read at all
    assert reader.chain("p1", a.lease.task_id, a.lease.gen) is not None
    assert counted.take() == (1, 0)  # its size
    # the grantor's scan through the same reader: nothing new either
    assert journal.journaled(storage, "p1", reader=reader) == {
        (a.lease.task_id, a.lease.gen): 0, (b.lease.task_id, b.lease.gen): 0}
    assert counted.take() == (1, 0)


def test_a_kept_reader_sees_a_torn_tail_completed_and_one_that_a_frame_followed(
        tmp_path: Path) -> None:
    """What a reader remembers stops before a torn tail: once the tail is whole the next
    read finds its frame; a last frame that failed its checksum (a torn tail) is corrupt
    once an intact frame follows it, and the reader forgets a segment that went."""
    storage, q, _, _, b = _two_leases(tmp_path)
    (key,) = record_keys(storage, "p1")
    whole = storage.read(key)
    bodies, _ = unframe(whole, key)
    last = len(whole) - len(bodies[-1]) - journal.FRAME.size
    reader = JournalReader(storage)
    lease_b = (b.lease.task_id, b.lease.gen)
    clobber(storage, key, whole[:last + journal.FRAME.size + 100])  # the last frame torn
    chain = reader.chain("p1", *lease_b, quarantine=q.quarantine)
    assert chain is not None and len(chain) == 3
    clobber(storage, key, whole)  # its append finished
    chain = reader.chain("p1", *lease_b, quarantine=q.quarantine)
    assert chain is not None and len(chain) == 4
    clobber(storage, key, whole[:last])  # shorter than what it found: not the file it read
    chain = reader.chain("p1", *lease_b, quarantine=q.quarantine)
    assert chain is not None and len(chain) == 3
    assert all(pos < last for _, pos in reader._bodies)  # nothing kept of the other file
    clobber(storage, key, whole)
    damaged = bytearray(whole)
    damaged[-10] ^= 0xFF  # inside the last frame's columns: a tail whose bytes never landed
    reader = JournalReader(storage)
    clobber(storage, key, bytes(damaged))
    chain = reader.chain("p1", *lease_b, quarantine=q.quarantine)
    assert chain is not None and len(chain) == 3
    assert storage.list("quarantine") == []
    clobber(storage, key, bytes(damaged) + whole[last:])  # an intact frame after it
    assert reader.chain("p1", *lease_b, quarantine=q.quarantine) is None
    assert record_keys(storage, "p1") == [] and storage.list("quarantine")
    assert reader._scans == {} and reader._bodies == {}  # nothing kept of a corrupt file


def test_a_producer_reads_a_parks_record_once_for_all_the_groups_it_resumes(
        tmp_path: Path) -> None:
    """Four groups parked into one record; another producer's loader resumes all four and
    reads that segment once (before: whole, at each of the four claims)."""
    storage = PosixStorage(str(tmp_path / "run"))
    q = run_with_tasks(storage, tmp_path, 4, group_size=G)
    table, groups, j, io, book, hb = parking(q, "p1", 4, segments=True)

    async def park() -> None:
        io.start()
        for a in groups:
            assert a.run is not None
            for s in a.run.samples:
                generate(s, 1500)
            a.parking = True
        await asyncio.gather(*(hb.yield_partial(a.lease, a.run.to_group(
            producer="p1", version_hint=0, partial=True)) for a in groups if a.run))
        io.shutdown()

    asyncio.run(park())
    (key,) = record_keys(storage, "p1")
    size = storage.size(key)
    config = ProducerConfig(run_dir=str(tmp_path / "run"),
                            engine=EngineConfig(workers=("http://127.0.0.1:9",)),
                            plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"))
    loader = GroupLoader(config, queue=q, group_size=G, book=book)
    counted = Counted(storage)
    for lease in q.claim("p2", 4):
        assert lease.journal == "p1"
        _, group, _ = loader.load(lease)
        assert group is not None and group.sample_lens == [1500] * G
    calls, got = counted.take()
    assert got <= size + HEAD and calls <= 4 + 3, (calls, got, size)
