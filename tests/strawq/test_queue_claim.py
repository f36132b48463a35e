"""Release and claim: claim order, attempts counted and refunded, failures requeued or
dropped with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.errors import ConfigError, LeaseLost
from strawq.ondisk import records
from strawq.ondisk.names import TaskName, note_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.testing import audit_run
from strawq.testing.factories import make_partial, prompts
from strawq.views.status import run_status
from tests.strawq.queue_helpers import ids, make_feeder, make_queue, tid


def test_release_puts_rows_in_pending_in_dataset_order(storage: Storage,
                                                       tmp_path: Path) -> None:
    q = make_queue(storage, release_batch=4)
    f = make_feeder(q, tmp_path, 10)
    assert f.release() == 4
    assert f.release(3) == 3
    keys = q.list_pending()
    assert [TaskName.parse(k.rsplit("/", 1)[1]).id for k in keys] == [tid(i) for i in range(7)]
    assert all(k.startswith("pending/r-") for k in keys)
    assert f.cursor.next_index == 7 and not f.exhausted
    rec = records.decode(storage.read(keys[2]), expect=Kind.TASK)
    assert rec.meta["task"] == {"index": 2, "id": tid(2), "row": prompts(10)[2], "pass": 0,
                                "source_row": 2}
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(7)]) == []
    assert audit.counts()["pending"] == 7


def test_claim_order_partials_by_version_then_returned_then_fresh(storage: Storage,
                                                                   tmp_path: Path) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 12)
    f.release(4)
    f.release(4)
    first = q.claim("p1", 5)
    assert ids(first) == [tid(i) for i in range(5)]
    by_id = {lease.task_id: lease for lease in first}
    q.yield_partial(by_id[tid(4)], make_partial(tid(4), 4, version=7))
    q.yield_partial(by_id[tid(1)], make_partial(tid(1), 1, version=3))
    q.yield_partial(by_id[tid(3)], make_partial(tid(3), 3, version=3))
    q.release(by_id[tid(2)])
    q.release(by_id[tid(0)])
    f.release(4)
    order = ids(q.claim("p2", 20))
    # partials by min version (ties in dataset order), returned in dataset order, then fresh
    assert order == [tid(1), tid(3), tid(4), tid(0), tid(2),
                     *(tid(i) for i in range(5, 12))]


def test_claim_never_returns_more_than_asked_or_pending(storage: Storage,
                                                        tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 3).release(3)
    assert q.claim("p", 0) == []
    assert len(q.claim("p", 2)) == 2
    assert len(q.claim("p", 5)) == 1
    assert q.claim("p", 5) == []
    with pytest.raises(ConfigError):
        q.claim("bad producer/../x", 1)


def test_attempts_counted_at_claim_refunded_by_yield_and_release(storage: Storage,
                                                                 tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=2)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen, lease.producer) == (1, 0, "p")
    q.release(lease)
    state, name = q.find(tid(0))
    assert (state, name.attempts, name.gen) == ("pending", 0, 1)
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen) == (1, 1)
    q.yield_partial(lease, make_partial(tid(0)))
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen, lease.name.resume) == (1, 2, 1)
    # many refunded cycles never exhaust max_attempts
    for _ in range(5):
        q.release(lease)
        (lease,) = q.claim("p")
    assert lease.name.attempts == 1 and lease.gen == 7


def test_fail_requeues_then_drops_at_max_attempts(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=2)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    dst = q.fail(lease, "engine_error", "HTTP 500 from engine")
    assert dst.startswith("pending/")
    note = records.decode(storage.read(note_key(tid(0), 0, "fail", "engine_error")),
                          expect=Kind.FAIL)
    assert note.meta["reason"] == "engine_error" and "HTTP 500" in note.meta["message"]
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen) == (2, 1)
    dst = q.fail(lease, "engine_error", "HTTP 500 again")
    assert dst.startswith("dropped/")
    state, name = q.find(tid(0))
    assert (state, name.producer) == ("dropped", "engine_error.max_attempts")
    note = records.decode(storage.read(note_key(tid(0), 1, "drop", "engine_error.max_attempts")),
                          expect=Kind.DROP)
    assert note.meta["reason"] == "engine_error.max_attempts"
    assert note.meta["attempts"] == 2
    assert q.claim("p") == []
    assert audit_run(storage).check([tid(0)]) == []
    assert run_status(q).dropped_by_reason == {"engine_error.max_attempts": 1}


def test_fail_not_retryable_drops_at_once(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=5)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.fail(lease, "prompt_too_long", "4097 > 4096 tokens", retryable=False)
    assert q.find(tid(0))[1].producer == "prompt_too_long"
    with pytest.raises(ConfigError):
        q.fail(lease, "bad reason!", "")


def test_drop_records_reason_and_summary(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    a, b = q.claim("p", 2)
    q.drop(a, "zero_reward_variance", "all rewards 1.0", summary={"rewards": [1.0, 1.0]})
    note = records.decode(storage.read(note_key(a.task_id, a.gen, "drop", "zero_reward_variance")),
                          expect=Kind.DROP)
    assert note.meta["summary"] == {"rewards": [1.0, 1.0]}
    assert q.find(a.task_id)[0] == "dropped"
    assert q.find(b.task_id)[0] == "leased"
    before = audit_run(storage)
    try:  # a retried drop: fenced, or (POSIX, NFS retry rule) a no-op success
        q.drop(a, "zero_reward_variance")
    except LeaseLost:
        pass
    after = audit_run(storage)
    assert after.entries == before.entries and after.check([a.task_id, b.task_id]) == []
    with pytest.raises(LeaseLost):
        q.drop(a, "another_reason")
