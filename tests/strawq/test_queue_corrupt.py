"""Corrupt records: detected, quarantined, reported; never a crash, never a default."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from strawq.data.cursor import list_cursors
from strawq.data.feeder import Feeder
from strawq.delivery.batches import BatchStore
from strawq.errors import CorruptRecord
from strawq.ondisk.names import data_key
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.testing import audit_run, make_group
from strawq.testing.factories import make_partial
from strawq.views.status import run_status
from tests.strawq.queue_helpers import clobber, ids, make_feeder, make_queue, tid


def _corruptions(good: bytes) -> dict[str, bytes]:
    flipped = bytearray(good)
    flipped[len(flipped) // 2 + 20 if len(flipped) > 80 else 40] ^= 0x40
    return {"empty": b"", "truncated": good[: len(good) // 2], "header_only": good[:32],
            "bitflip": bytes(flipped), "garbage": b"\x00" * 64}


CORRUPTIONS = ["empty", "truncated", "header_only", "bitflip", "garbage"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_task_record_is_quarantined_on_claim(storage: Storage, tmp_path: Path,
                                                     how: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 3).release(3)
    key = q.list_pending()[1]
    good = storage.read(key)
    clobber(storage, key, _corruptions(good)[how])
    with caplog.at_level(logging.ERROR):
        leases = q.claim("p", 3)
    assert ids(leases) == [tid(0), tid(2)]
    assert any("quarantined" in r.message for r in caplog.records)
    (qname,) = storage.list("quarantine")
    assert storage.read(f"quarantine/{qname}") == _corruptions(good)[how], \
        "the bad bytes must be kept for inspection"
    st = run_status(q)
    assert st.quarantined == 1 and st.counts["leased"] == 2
    audit = audit_run(storage)
    assert audit.state_of(tid(1)) == "quarantined"
    assert audit.check([tid(0), tid(1), tid(2)]) == []


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_group_payload_is_quarantined(storage: Storage, tmp_path: Path,
                                              how: str) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.complete(lease, make_group(tid(0), lens=(40, 30)))
    key = data_key(tid(0), 0, "group")
    clobber(storage, key, _corruptions(storage.read(key))[how])
    with pytest.raises(CorruptRecord) as info:
        q.read_group(tid(0), 0)
    assert key in str(info.value)
    assert storage.list("quarantine") == [key.replace("/", "+")]
    assert run_status(q).quarantined == 1


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_partial_is_quarantined_on_resume(storage: Storage, tmp_path: Path,
                                                  how: str) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.yield_partial(lease, make_partial(tid(0), lens=(30, 20)))
    key = data_key(tid(0), 0, "partial")
    clobber(storage, key, _corruptions(storage.read(key))[how])
    (lease,) = q.claim("p")
    with pytest.raises(CorruptRecord):
        q.load_partial(lease)
    assert storage.list("quarantine") == [key.replace("/", "+")]
    assert q.still_held(lease)  # the task itself is not lost: the producer can fail it
    q.fail(lease, "corrupt_partial", "prefix record failed its checksum", retryable=False)
    assert q.find(tid(0))[0] == "dropped"


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_manifest_is_quarantined_by_gc(storage: Storage, tmp_path: Path,
                                               how: str) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    for lease in q.claim("p", 2):
        q.complete(lease, make_group(lease.task_id))
    bs = BatchStore(q)
    bs.publish_batch(1, bs.scan_ready())
    bs.ack(1)
    key = "batches/000000000001"
    clobber(storage, key, _corruptions(storage.read(key))[how])
    rep = bs.gc()
    assert rep.batches == 0
    assert storage.list("quarantine") == [key.replace("/", "+")]
    assert run_status(q).quarantined == 1


def test_corrupt_manifest_does_not_crash_recover(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    for lease in q.claim("p", 2):
        q.complete(lease, make_group(lease.task_id))
    bs = BatchStore(q)
    bs.publish_batch(1, bs.scan_ready())
    clobber(storage, "batches/000000000001", b"")
    BatchStore(q).recover()
    assert storage.list("quarantine") == ["batches+000000000001"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_newest_cursor_is_quarantined_and_reported(storage: Storage, tmp_path: Path,
                                                           how: str) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 10)
    f.release(3)
    f.release(3)
    key = "cursor/" + next(n for s, _, n in list_cursors(storage) if s == 2)
    clobber(storage, key, _corruptions(storage.read(key))[how])
    st = run_status(q)  # must not crash while the bad cursor is still in place
    assert st.counts["pending"] == 6
    assert st.cursor["next_index"] == 6  # the cursor's name still says where it stood
    f2 = Feeder(q, f.dataset)
    assert storage.list("quarantine") == [key.replace("/", "+")]
    # repaired: a new cursor record continues from the damaged one's index, nothing re-released
    assert f2.cursor.seq == 3 and f2.cursor.next_index == 6
    assert run_status(q).quarantined == 1


def test_release_after_corrupt_newest_cursor_loses_nothing(storage: Storage,
                                                          tmp_path: Path) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 10)
    f.release(3)
    f.release(3)
    clobber(storage, "cursor/" + next(n for s, _, n in list_cursors(storage) if s == 2), b"")
    f2 = Feeder(q, f.dataset)
    while f2.release(4):
        pass
    Feeder(q, f.dataset)
    assert audit_run(storage).check([tid(i) for i in range(10)]) == []


def test_corrupt_run_meta_is_an_error_not_a_default(storage: Storage) -> None:
    make_queue(storage)
    clobber(storage, "run.meta", b"SQRC" + b"\x00" * 40)
    with pytest.raises(CorruptRecord):
        RunQueue.open(storage)


def test_foreign_file_in_pending_is_ignored_not_claimed(storage: Storage,
                                                        tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    storage.publish("pending/README", b"not a task")
    assert ids(q.claim("p", 5)) == [tid(0)]
    assert storage.exists("pending/README")


def _released(storage: Storage) -> list[int]:
    from strawq.tasks.states import TaskState, names_in

    return sorted(int(n.id[1:]) for n in names_in(storage, TaskState.PENDING))


@pytest.mark.parametrize("released_before", [6, 4, 8])
def test_a_corrupt_cursor_in_a_later_pass_is_repaired_with_its_passes(
        storage: Storage, tmp_path: Path, released_before: int) -> None:
    """The repair of a damaged newest cursor keeps the run's passes (``epoch_bases``) and
    the pass's base from the newest intact record: every pass releases each row once, and
    no pass is added. 6: the damaged record is a release inside pass 2; 4 and 8: the
    record that starts pass 2 (or 3) at a pass boundary is the damaged one."""
    q = make_queue(storage, num_epochs=3)
    f = make_feeder(q, tmp_path, 4)
    while len(_released(storage)) < released_before:
        f.release(2)
    if released_before % 4 == 0:
        f.release(0)  # only the commit that opens the next pass (no row taken yet)
    newest = list_cursors(storage)[-1][2]
    clobber(storage, f"cursor/{newest}", b"")
    f2 = Feeder(q, f.dataset)
    while not f2.exhausted:
        if not f2.release(3):
            break
    assert _released(storage) == list(range(12))  # 3 passes of 4 rows, each once
    assert f2.cursor.epoch_bases == (0, 4, 8) and f2.exhausted
    assert audit_run(storage).check([tid(i) for i in range(12)]) == []
