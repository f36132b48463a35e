"""A batch's commit is its manifest alone (docs/protocol.md §5, "The per-group cut"): the
groups it names stay in ``ready/``, BATCHED because a manifest names them, and every reader
that tells READY from BATCHED lists ``batches/`` first. A run an older strawq wrote, whose
batches renamed their groups to ``batched/``, is still read, recovered and collected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strawq.delivery.batches import BatchStore, queue_depths
from strawq.delivery.checkpoint import in_flight
from strawq.ondisk import records
from strawq.ondisk.names import TaskName, data_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, key_of, move
from strawq.testing import audit_run, make_group
from strawq.views.status import run_status
from tests.strawq.queue_helpers import make_feeder, make_queue, tid
from tests.strawq.test_meta_ops import CountingStorage


def _ready(q: RunQueue, tmp_path: Path, n: int) -> list[TaskName]:
    make_feeder(q, tmp_path, n).release(n)
    for lease in q.claim("p", n):
        q.complete(lease, make_group(lease.task_id, int(lease.task_id[1:])))
    return BatchStore(q).scan_ready()


def test_a_batch_renames_none_of_its_groups(tmp_path: Path) -> None:
    """Publishing a batch of 8 is one create (its manifest): before, 8 renames ready/ ->
    batched/ followed it, 5.2 metadata operations a group on JuiceFS."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st)
    names = _ready(q, tmp_path, 10)
    bs = BatchStore(q)
    st.ops.clear()
    bs.publish_batch(1, names[:8])
    assert st.ops["rename"] == 1, st.ops  # the manifest's own publish (temp file -> name)
    assert sorted(st.list("ready")) == sorted(str(n) for n in names)
    assert st.list("batched") == []
    d = queue_depths(st)
    assert (d.ready, d.batched) == (2, 8)
    assert run_status(q).counts["ready"] == 2 and run_status(q).counts["batched"] == 8
    assert audit_run(st).counts()["batched"] == 8


def test_every_store_skips_the_groups_a_manifest_names(storage: Storage,
                                                       tmp_path: Path) -> None:
    """A store that never published (a takeover collector, another process) reads the
    manifests: it never offers a batched group again (invariant 1)."""
    q = make_queue(storage)
    names = _ready(q, tmp_path, 5)
    BatchStore(q).publish_batch(1, names[:3])
    other = BatchStore(RunQueue.open(storage))
    assert [n.id for n in other.scan_ready()] == [tid(3), tid(4)]
    assert other.batched_in_ready == 3
    other.publish_batch(2, other.scan_ready())
    assert other.scan_ready() == []
    successor = BatchStore(RunQueue.open(storage))
    assert successor.scan_ready() == [] and successor.batched_in_ready == 5


def test_the_publishing_store_lists_the_manifests_once(tmp_path: Path) -> None:
    """The collector knows what it publishes and retires: after its first scan it lists
    ``ready/`` alone, as before the cut (a listing of ``batches/`` per poll would cost ~3
    metadata operations each on JuiceFS)."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st)
    names = _ready(q, tmp_path, 6)
    bs = BatchStore(q)
    assert len(bs.scan_ready()) == 6
    bs.publish_batch(1, names[:2])
    bs.ack(1)
    st.ops.clear()
    for _ in range(5):
        assert len(bs.scan_ready()) == 4
    assert st.ops["list batches"] == 0 and st.ops["list ready"] == 5, st.ops
    bs.gc()
    assert [n.id for n in bs.scan_ready()] == [tid(i) for i in range(2, 6)]


class _GcBetweenListings:
    """Runs a whole GC just before the second of a scan's two listings (``batches/`` and
    ``ready/``), whichever it is: the collector's own GC, or ``strawq gc`` beside it."""

    def __init__(self, storage: Storage, gc: Any) -> None:
        self.storage, self.gc, self.seen = storage, gc, 0
        self.real = storage.list

    def __call__(self, directory: str) -> list[str]:
        if directory in ("batches", "ready") and self.seen < 2:
            self.seen += 1
            if self.seen == 2:
                self.gc()
        return self.real(directory)


def test_a_scan_racing_gc_never_offers_a_trained_group(storage: Storage,
                                                        tmp_path: Path) -> None:
    """GC deletes a group's entry before its manifest; a scan lists ``batches/`` first, so a
    manifest gone by then took its entries with it. Listed the other way round, the scan
    would offer the trained groups again, their payloads deleted."""
    q = make_queue(storage)
    names = _ready(q, tmp_path, 4)
    bs = BatchStore(q)
    bs.publish_batch(1, names[:3])
    bs.ack(1)
    scanner = BatchStore(RunQueue.open(storage))
    race = _GcBetweenListings(storage, lambda: BatchStore(RunQueue.open(storage)).gc())
    storage.list = race  # type: ignore[method-assign]
    try:
        got = scanner.scan_ready()
    finally:
        del storage.list
    assert race.seen == 2
    assert storage.list("batches") == [], "the GC did not run"
    assert [n.id for n in got] == [tid(3)]


def test_a_batched_group_dropped_by_the_trainer_leaves_ready(storage: Storage,
                                                             tmp_path: Path) -> None:
    """The reader drops a batched group whose payload fails its checks
    (``drop_from('batched')``): the entry is in ``ready/``."""
    q = make_queue(storage)
    names = _ready(q, tmp_path, 2)
    bs = BatchStore(q)
    bs.publish_batch(1, names)
    assert bs.drop_from("batched", names[0], "corrupt_group", "checksum")
    assert not storage.exists(key_of(TaskState.READY, names[0]))
    audit = audit_run(storage)
    assert audit.state_of(tid(0)) == "dropped" and audit.state_of(tid(1)) == "batched"
    assert not bs.drop_from("batched", names[0], "corrupt_group"), "dropped twice"


def test_what_is_in_flight_counts_a_batched_group_until_its_batch_is_trained(
        storage: Storage, tmp_path: Path) -> None:
    """A cursor resume re-releases what was in flight: a group of an unacked batch is, one
    of an acked (not yet collected) batch is not, though both entries are in ``ready/``."""
    q = make_queue(storage)
    make_feeder(q, tmp_path, 4).release(4)
    for lease in q.claim("p", 4):
        q.complete(lease, make_group(lease.task_id, int(lease.task_id[1:])))
    bs = BatchStore(q)
    names = bs.scan_ready()
    bs.publish_batch(1, names[:2])
    bs.publish_batch(2, names[2:3])
    bs.ack(1)
    assert len(storage.list("ready")) == 4
    assert in_flight(storage) == {2, 3}
    assert in_flight(storage, trained_through=2) == {3}


def _legacy_batch(q: RunQueue, seq: int, names: list[TaskName]) -> None:
    """A batch as an older strawq published it: the manifest, then each group renamed to
    ``batched/``."""
    body = {"seq": seq, "groups": [str(n) for n in names], "summaries": [], "meta": {},
            "at": 0.0}
    q.storage.publish(f"batches/{seq:012d}", records.encode(Kind.MANIFEST, body))
    for n in names:
        move(q.storage, n, TaskState.READY, TaskState.BATCHED)


def test_an_older_runs_batched_entries_are_read_dropped_and_collected(
        storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    names = _ready(q, tmp_path, 5)
    _legacy_batch(q, 1, names[:3])
    bs = BatchStore(RunQueue.open(storage))
    assert bs.recover() != []
    assert len(storage.list("batched")) == 3, "recovery moved a legacy batch's entries"
    assert [n.id for n in bs.scan_ready()] == [tid(3), tid(4)]
    assert queue_depths(storage).batched == 3
    bs.publish_batch(2, bs.scan_ready()[:1])  # a new batch beside it: left in ready/
    assert queue_depths(storage).batched == 4
    assert bs.drop_from("batched", names[2], "corrupt_group", "checksum")
    assert in_flight(storage) == {0, 1, 3, 4}
    bs.ack(1)
    bs.ack(2)
    rep = bs.gc()
    assert (rep.batches, rep.payloads) == (2, 4)
    assert storage.list("batched") == [] and [n.id for n in bs.scan_ready()] == [tid(4)]
    assert not storage.exists(data_key(tid(0), 0, "group"))
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(5)], trained={tid(0), tid(1), tid(3)}) == []


def test_an_older_runs_batched_entries_whose_manifest_is_lost_go_back(
        storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    names = _ready(q, tmp_path, 3)
    _legacy_batch(q, 1, names[:2])
    storage.delete("batches/000000000001")  # torn by a storage fault
    storage.publish("batches/000000000001", b"not a manifest")
    bs = BatchStore(RunQueue.open(storage))
    assert bs.recover() == []
    assert storage.list("batched") == []
    assert [n.id for n in bs.scan_ready()] == [tid(0), tid(1), tid(2)]


def test_a_store_forgets_the_manifests_another_process_retired(storage: Storage,
                                                               tmp_path: Path) -> None:
    """``strawq gc`` beside the collector retires batches the collector's store knows: its
    next GC forgets them (what it knows stays bounded), and forgets no manifest it has."""
    q = make_queue(storage)
    names = _ready(q, tmp_path, 6)
    bs = BatchStore(q)
    for seq in (1, 2, 3):
        bs.publish_batch(seq, names[2 * seq - 2:2 * seq])
    bs.ack(1)
    BatchStore(RunQueue.open(storage)).gc()  # another process collects batch 1
    bs.ack(2)
    assert bs.gc().batches == 1  # batch 2; batch 1 was gone already
    assert sorted(bs._named) == [3]
    assert bs.scan_ready() == [] and bs.batched_in_ready == 2
