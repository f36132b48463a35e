"""``strawq.delivery.requeue``: dropped tasks of one reason back into the queue, as fresh
generations, with their history kept, beside a live run and a racing drop compaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.delivery.requeue import requeue_dropped
from strawq.delivery.retention import compact_drops, drop_totals
from strawq.errors import LeaseLost, StrawqError
from strawq.ondisk import records
from strawq.ondisk.names import note_key
from strawq.storage import MemoryStorage, Storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.testing import audit_run, make_group
from strawq.testing.faults import FaultyStorage
from tests.strawq.queue_helpers import make_feeder, make_queue, tid


def _dropped_run(storage: Storage, tmp_path: Path) -> tuple[RunQueue, list[str]]:
    """Five released tasks: i0, i1 and i3 dropped as bad_task, i2 as zero_variance."""
    q = make_queue(storage)
    make_feeder(q, tmp_path, 5).release(5)
    leases = {lease.task_id: lease for lease in q.claim("p", 5)}
    for i in (0, 1, 3):
        q.fail(leases[tid(i)], "bad_task", "no tokenizer", retryable=False)
    q.drop(leases[tid(2)], "zero_variance", "filter")
    q.release(leases[tid(4)])
    return q, [tid(i) for i in range(5)]


def test_requeue_puts_one_reasons_drops_back_and_keeps_their_history(
        tmp_path: Path) -> None:
    q, released = _dropped_run(MemoryStorage(), tmp_path)
    dropped = {n.id: n for n in names_in(q.storage, TaskState.DROPPED)}
    rep = requeue_dropped(q, "bad_task")
    assert sorted(rep.requeued) == [tid(0), tid(1), tid(3)] and not rep.skipped
    assert [n.producer for n in names_in(q.storage, TaskState.DROPPED)] == ["zero_variance"]
    queued = {n.id: n for n in names_in(q.storage, TaskState.PENDING)}
    for i in (0, 1, 3):
        old, new = dropped[tid(i)], queued[tid(i)]
        assert (new.gen, new.attempts, new.resume, new.producer) == (old.gen + 1, 0, -1, None)
        assert q.storage.exists(note_key(old.id, old.gen, "drop", "bad_task"))  # kept
        note = records.decode(q.storage.read(note_key(new.id, new.gen, "requeue", "bad_task")))
        assert "requeued from dropped/" in note.meta["message"]
    audit = audit_run(q.storage)
    assert audit.check(released) == []  # every index in exactly one state
    assert drop_totals(q.storage) == {"zero_variance": 1}
    # a producer runs them as any returned task; a result of the dropped generation is fenced
    leases = {lease.task_id: lease for lease in q.claim("p2", 5)}
    assert set(leases) == {tid(0), tid(1), tid(3), tid(4)}
    stale = leases[tid(0)].__class__(name=dropped[tid(0)].with_(producer="p"),
                                     task=leases[tid(0)].task)
    with pytest.raises(LeaseLost):
        q.complete(stale, make_group(tid(0), version=0))
    q.complete(leases[tid(0)], make_group(tid(0), version=0))
    assert audit_run(q.storage).check(released) == []


def test_a_dry_run_writes_nothing_and_bad_rows_are_refused(tmp_path: Path) -> None:
    q, _ = _dropped_run(MemoryStorage(), tmp_path)
    before = {d: sorted(q.storage.list(d)) for d in ("pending", "dropped", "data")}
    rep = requeue_dropped(q, "bad_task", dry_run=True)
    assert sorted(rep.requeued) == [tid(0), tid(1), tid(3)] and rep.dry_run
    assert {d: sorted(q.storage.list(d)) for d in before} == before
    assert requeue_dropped(q, "no_such_reason").requeued == []
    with pytest.raises(StrawqError, match="bad_row.*no task to run"):
        requeue_dropped(q, "bad_row")
    assert len(requeue_dropped(q, "bad_task", limit=2).requeued) == 2


class _KeepEntries(FaultyStorage):
    """The compactor's deletions and its moves of the entries into the audit's kept records,
    which come after the requeue's moves in this race."""

    def delete(self, key: str, *, missing_ok: bool = True) -> None:
        pass

    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        if not dst.startswith("audit/kept/"):
            super().rename(src, dst, sync_dir=sync_dir)


class _CompactionRaces(FaultyStorage):
    """A drop compaction lists and publishes its audit segment just before the requeue's
    first move, and deletes its entries only after the requeue moved them."""

    fired = False

    def rename(self, src: str, dst: str, *, sync_dir: bool = True) -> None:
        if src.startswith("dropped/") and not self.fired:
            self.fired = True
            assert compact_drops(_KeepEntries(self.inner)) == 4
        super().rename(src, dst, sync_dir=sync_dir)


def test_a_compaction_racing_the_requeue_does_not_count_requeued_tasks_as_dropped(
        tmp_path: Path) -> None:
    storage = MemoryStorage()
    q, released = _dropped_run(storage, tmp_path)
    racing = RunQueue(_CompactionRaces(storage), q.config)
    rep = requeue_dropped(racing, "bad_task")
    assert sorted(rep.requeued) == sorted(rep.corrected) == [tid(0), tid(1), tid(3)]
    assert drop_totals(storage) == {"zero_variance": 1}
    assert audit_run(storage).check(released) == []
    compact_drops(storage)  # the next compaction finishes the first one's deletions
    assert drop_totals(storage) == {"zero_variance": 1}
    assert {n.id for n in names_in(storage, TaskState.PENDING)} == {tid(0), tid(1), tid(3),
                                                                    tid(4)}
