"""Weight versions, the staleness-first ready scan, batches, acks and garbage collection."""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.delivery.batches import BatchStore
from strawq.errors import ConfigError, NotFound, TaskNotFound
from strawq.ondisk import records
from strawq.ondisk.names import data_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.testing import audit_run, make_group
from strawq.testing.factories import make_partial
from strawq.views.status import run_status
from strawq.weights.control import Control
from tests.strawq.queue_helpers import make_feeder, make_queue, tid


def test_weight_versions_are_monotonic(storage: Storage) -> None:
    q = make_queue(storage)
    assert q.current_version() == 0
    q.set_version(3)
    q.set_version(3)
    q.set_version(5)
    assert q.current_version() == 5 and storage.list("versions") == ["000000000005"]
    with pytest.raises(ConfigError, match="must not go back"):
        q.set_version(4)


def _ready_with_versions(q: RunQueue, tmp_path: Path, versions: list[int]) -> None:
    make_feeder(q, tmp_path, len(versions)).release(len(versions))
    for lease in q.claim("p", len(versions)):
        i = int(lease.task_id[1:])
        q.complete(lease, make_group(lease.task_id, i, version=versions[i]))


def test_ready_scan_is_staleness_first_then_fifo(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [4, 2, 4, 0, 2])
    bs = BatchStore(q)
    names = bs.scan_ready()
    assert [n.id for n in names] == [tid(3), tid(1), tid(4), tid(0), tid(2)]
    summary = bs.read_summary(names[0])
    assert summary["task_id"] == tid(3) and summary["min_version"] == 0
    q.set_version(5)
    assert run_status(q).staleness == {"ready/mean": 5 - 12 / 5, "ready/max": 5.0}


def test_publish_batch_ack_and_gc(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [0, 0, 1, 1, 2])
    bs = BatchStore(q)
    seq = bs.next_seq()
    assert seq == 1
    first = bs.scan_ready()[:3]
    man = bs.publish_batch(seq, first, meta={"step": 1})
    assert [n.id for n in man.groups] == [tid(0), tid(1), tid(2)]
    assert bs.read_manifest(1).meta == {"step": 1}
    assert [n.id for n in bs.scan_ready()] == [tid(3), tid(4)]
    assert run_status(q).counts["batched"] == 3 and run_status(q).batches_unacked == 1
    assert bs.gc().batches == 0  # not acked: nothing to collect
    with pytest.raises(NotFound):
        bs.ack(7)
    bs.ack(1)
    bs.ack(1)
    rep = bs.gc()
    assert (rep.batches, rep.payloads) == (1, 3)
    assert storage.list("batched") == [] and storage.list("batches") == []
    assert not storage.exists(data_key(tid(0), 0, "group"))
    assert storage.exists(data_key(tid(3), 0, "group"))
    assert bs.next_seq() == 2, "a garbage-collected batch seq must never be reused"
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(5)], trained={tid(0), tid(1), tid(2)}) == []


def test_batch_recover_reads_a_commit_a_crash_interrupted(storage: Storage,
                                                         tmp_path: Path) -> None:
    """A collector died right after its manifest's create: its successor's recovery reads it,
    and the groups it names are never offered again."""
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [0, 1, 2])
    names = BatchStore(q).scan_ready()[:2]
    body = {"seq": 1, "groups": [str(n) for n in names], "summaries": [], "meta": {},
            "at": 0.0}
    storage.publish("batches/000000000001", records.encode(Kind.MANIFEST, body))
    bs = BatchStore(q)
    pending = bs.recover()
    assert [m.seq for m in pending] == [1]
    assert [n.id for n in bs.scan_ready()] == [tid(2)]
    assert audit_run(storage).check([tid(i) for i in range(3)]) == []


def test_stale_ready_groups_requeued_or_dropped(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [0, 0])
    bs = BatchStore(q)
    a, b = bs.scan_ready()
    assert bs.requeue_ready(a)
    assert bs.drop_ready(b, "too_stale", "staleness 9 > eta 4")
    assert not bs.requeue_ready(b) and not bs.drop_ready(a, "too_stale")
    state, name = q.find(a.id)
    assert (state, name.gen, name.attempts) == ("pending", a.gen + 1, a.attempts - 1)
    assert q.find(b.id)[1].producer == "too_stale"
    assert not storage.exists(data_key(a.id, a.gen, "group"))
    assert audit_run(storage).check([a.id, b.id]) == []


def test_gc_full_removes_only_fenced_generations(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.yield_partial(lease, make_partial(tid(0)))          # data/i0~g0.partial (resume)
    (lease,) = q.claim("p")
    q.yield_partial(lease, make_partial(tid(0)))          # data/i0~g1.partial (resume)
    # the superseded prefix goes with the yield that replaced it
    assert not storage.exists(data_key(tid(0), 0, "partial"))
    storage.publish(data_key(tid(0), 0, "group"), make_group(tid(0)).encode())  # orphan
    rep = BatchStore(q).gc(full=True)
    assert rep.stale == 1
    assert storage.list("data") == [f"{tid(0)}~g1.partial"]
    (lease,) = q.claim("p")
    assert q.load_partial(lease) is not None


def test_drained_release_directories_are_collected(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, release_batch=2)
    f = make_feeder(q, tmp_path, 6)
    while f.release():
        pass
    for lease in q.claim("p", 6):
        q.complete(lease, make_group(lease.task_id))
    bs = BatchStore(q)
    bs.publish_batch(bs.next_seq(), bs.scan_ready())
    bs.ack(1)
    bs.gc(full=True)
    assert storage.list("pending") == []


def test_find_and_task_not_found(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    with pytest.raises(TaskNotFound) as info:
        q.find("i999")
    assert isinstance(info.value, KeyError) and "i999" in str(info.value)
    assert q.find(tid(0))[0] == "pending"


def test_control_bracket(storage: Storage) -> None:
    c = Control(storage)
    assert not c.state().paused
    c.pause(1)
    c.pause(1)
    c.ack(1, "p1", partials=2)
    c.ack(1, "p2")
    st = c.state()
    assert st.paused and st.pause_version == 1 and st.acks == {"p1", "p2"}
    c.resume(1)
    assert not c.state().paused and c.state().resume_version == 1
    with pytest.raises(ConfigError):
        c.ack(2, "../evil")
    for v in range(2, 8):
        c.pause(v)
        c.resume(v)
    assert all(int(n.split("-")[1].split("~")[0]) > 7 - 4 for n in storage.list("control"))
