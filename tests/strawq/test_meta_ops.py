"""What the queue's steps cost in filesystem operations (docs/protocol.md §5, "Metadata
operations per group"): on a shared mount every name operation is a round trip to the
metadata service, so these tests count them on a local directory and pin the ones removed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from strawq.delivery.batches import BatchStore
from strawq.storage import MemoryStorage, PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing.faults import FaultyStorage
from tests.strawq.queue_helpers import make_feeder, make_queue, tid


class CountingStorage(PosixStorage):
    """A ``PosixStorage`` that counts the renames it makes and the files it creates."""

    def __init__(self, root: str, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.ops: Counter[str] = Counter()
        self._tmp_root = "tmp/"  # keys under it: temporary files

    def _rename_noreplace(self, at: Any, src: str, dst: str) -> None:
        self.ops["rename"] += 1
        super()._rename_noreplace(at, src, dst)

    def list(self, directory: str) -> list[str]:
        self.ops[f"list {directory}"] += 1
        return super().list(directory)

    def _fill(self, fd: int, key: str, chunks: Any, sync: bool) -> None:
        self.ops["create tmp" if key.startswith(self._tmp_root) else "create in place"] += 1
        super()._fill(fd, key, chunks, sync)


def test_a_release_writes_its_task_records_in_place(tmp_path: Path) -> None:
    """A release's task records are written straight into its private staging directory:
    one create each, no temporary file and no rename per record (on JuiceFS that saved
    2 GetAttr, a Lookup and a Rename per group). The release's own renames remain: the
    cursor commit and the promotion of the staging directory to ``pending/``."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=32)
    feeder = make_feeder(q, tmp_path, 32)
    st.ops.clear()
    assert feeder.release() == 32
    assert st.ops["rename"] == 2, st.ops
    assert st.ops["create tmp"] == 0, st.ops
    assert st.ops["create in place"] == 33, st.ops  # 32 task records + the cursor record
    assert len(q.list_pending()) == 32
    assert st.list("staging") == [] and st.list("tmp") == []


def test_an_idle_gc_lists_only_the_acks(tmp_path: Path) -> None:
    """With nothing acked there is nothing to collect: GC lists ``acked/`` and stops, not
    ``batches/`` and ``committed/`` too (the collector runs it every ``gc_interval_s``)."""
    st = MemoryStorage()
    q = make_queue(st)
    faulty = FaultyStorage(st)
    BatchStore(RunQueue(faulty, q.config)).gc()
    assert [k for op, k in faulty.log if op == "list"] == [("acked",)]


class _PublishesAndAcksDuringItsListing(FaultyStorage):
    """Another collector's batch is published and acked while GC lists ``batches/``."""

    def list(self, directory: str) -> list[str]:
        names = super().list(directory)
        if directory == "batches":
            other = BatchStore(RunQueue.open(self.inner))
            other.publish_batch(9, [])
            other.ack(9)
        return names


def test_gc_keeps_the_ack_of_a_batch_published_and_acked_while_it_lists(
        tmp_path: Path) -> None:
    st = MemoryStorage()
    q = make_queue(st)
    bs = BatchStore(q)
    bs.publish_batch(1, [])
    bs.ack(1)  # something acked, so GC lists the manifests too
    BatchStore(RunQueue(_PublishesAndAcksDuringItsListing(st), q.config)).gc()
    assert st.list("batches") == ["000000000009"]
    assert st.list("acked") == ["000000000009"], "the new batch's ack was taken for an orphan"


def test_a_claimer_lists_a_release_directory_once(tmp_path: Path) -> None:
    """A release directory never gains a name: a claimer that listed it whole claims from
    that listing to the end and then removes it with ``rmdir`` alone, instead of listing
    it again at every claim once fewer than 16 cached names were left."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=32)
    make_feeder(q, tmp_path, 32).release()
    (release,) = st.list("pending")
    st.ops.clear()
    claimed = [lease.task_id for _ in range(32) for lease in q.claim("p0", 1)]
    assert claimed == [tid(i) for i in range(32)]
    assert q.claim("p0", 1) == []
    assert st.ops[f"list pending/{release}"] == 1, st.ops
    assert st.list("pending") == [], "the drained release directory is removed"


def test_a_claimer_lists_a_release_directory_again_once_it_lost_a_race_there(
        tmp_path: Path) -> None:
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=20)
    make_feeder(q, tmp_path, 20).release()
    (release,) = st.list("pending")
    mine = RunQueue.open(st)
    assert [lease.task_id for lease in mine.claim("p0", 1)] == [tid(0)]
    # another claimer takes the next 10 behind this one's back
    assert len(RunQueue.open(PosixStorage(st.root)).claim("p1", 10)) == 10
    st.ops.clear()
    assert [lease.task_id for lease in mine.claim("p0", 1)] == [tid(11)]
    # the first 10 lost races made the listing stale: the next refill lists it again
    rest = [lease.task_id for _ in range(8) for lease in mine.claim("p0", 1)]
    assert sorted(rest) == [tid(i) for i in range(12, 20)]  # (after a lost race, a
    # claimer starts at its own offset in the head of the list: not quite in order)
    assert st.ops[f"list pending/{release}"] == 1, st.ops


def test_a_claim_whose_cached_names_were_all_taken_lists_again_instead_of_claiming_nothing(
        tmp_path: Path) -> None:
    """A claimer that listed one release directory whole (enough names for its claims)
    and found every one of them taken by others since, while a second release it never
    listed holds tasks: before, its claim came back empty (one claim in four at 1,000
    GPUs in the live control-plane run, where a producer claims every ~37 s); now it
    lists again and claims from the second release."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=20)
    feeder = make_feeder(q, tmp_path, 40)
    feeder.release()
    feeder.release()
    mine = RunQueue.open(st)
    assert [lease.task_id for lease in mine.claim("p0", 1)] == [tid(0)]
    # another producer takes the rest of the first release (all this claimer cached)
    assert len(RunQueue.open(PosixStorage(st.root)).claim("p1", 19)) == 19
    got = [lease.task_id for lease in mine.claim("p0", 1)]
    assert got == [tid(20)], got


def test_a_claimer_with_names_cached_does_not_list_the_top_again_within_the_interval(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Claims one at a time within ``TOP_LIST_INTERVAL_S`` of the last listing of the top
    of ``pending/`` are served from the cache while it holds a name for them: before, each
    of the last 15 claims of a release listed the top again (fewer than 16 cached names),
    about 0.25 listings a group (3 GetAttr and a NewDirHandler each on JuiceFS)."""
    from strawq.tasks import claims

    clock = [100.0]
    monkeypatch.setattr(claims.time, "monotonic", lambda: clock[0])
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=32)
    make_feeder(q, tmp_path, 32).release()
    st.ops.clear()
    claimed = [lease.task_id for _ in range(32) for lease in q.claim("p0", 1)]
    assert claimed == [tid(i) for i in range(32)]
    assert st.ops["list pending"] == 1, st.ops
    # drained: the next claim past the interval lists the top again, and finds nothing
    clock[0] += 2 * claims.TOP_LIST_INTERVAL_S
    assert q.claim("p0", 1) == []
    assert st.ops["list pending"] == 2, st.ops


def test_a_partial_task_handed_back_elsewhere_is_claimed_first_after_the_interval(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The cut above keeps the bound on priority: a task handed back by another process is
    claimed ahead of cached fresh names once ``TOP_LIST_INTERVAL_S`` has passed."""
    from strawq.tasks import claims

    clock = [100.0]
    monkeypatch.setattr(claims.time, "monotonic", lambda: clock[0])
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=32)
    make_feeder(q, tmp_path, 32).release()
    assert [x.task_id for x in q.claim("p0", 1)] == [tid(0)]
    other = RunQueue.open(PosixStorage(st.root))
    (theirs,) = other.claim("p1", 1)
    other.release(theirs)  # returned: at the top of pending/, ahead of fresh tasks
    assert [x.task_id for x in q.claim("p0", 1)] == [tid(2)]  # within the interval
    clock[0] += 2 * claims.TOP_LIST_INTERVAL_S
    assert [x.task_id for x in q.claim("p0", 1)] == [theirs.task_id]


def test_claimers_that_lost_races_list_again_and_spread_out(
        tmp_path: Path, monkeypatch: Any) -> None:
    """16 claimers list one release of 256, then claim one task each in turn, within one
    ``TOP_LIST_INTERVAL_S`` (a fixed clock): the worst case of stale caches. Each lost
    race costs a rename attempt (a Lookup, and more, on JuiceFS). A claimer that lost races
    lists the release again at its next claim, and starts at its own offset in a head as
    wide as the races it lost: 4.1 lost races a claim over 12 rounds, against 14.4 before
    (when it kept walking its stale cache, from an offset within the first 4 names), for
    0.8 listings a claim instead of 0.2."""
    from strawq.tasks import claims

    monkeypatch.setattr(claims.time, "monotonic", lambda: 100.0)
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=256)
    make_feeder(q, tmp_path, 256).release()
    stores = [CountingStorage(st.root) for _ in range(16)]
    claimers = [RunQueue.open(s) for s in stores]
    for j, c in enumerate(claimers):
        assert len(c._claimer.candidates(f"p{j}", 1)) == 256
    won: list[str] = []
    for _round in range(12):
        for j, c in enumerate(claimers):
            won += [lease.task_id for lease in c.claim(f"p{j}", 1)]
    assert len(won) == len(set(won)) == 192  # one winner per task, every claim served
    lost = sum(s.ops["rename"] for s in stores) - len(won)
    assert lost <= 6 * len(won), lost
