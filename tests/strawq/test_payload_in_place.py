"""A lease's payload is written in place (docs/protocol.md §5, "The per-group cut"): no
temporary name and no rename of its own, because nothing reads ``data/<task>~g<gen>``
until the fencing rename that follows names it, and only the holder of generation ``gen``
writes it. A crash mid-write leaves a partial payload that no entry names: the holder's
own retry writes it again, the audit does not count it as a torn record, and the sweep of
payloads deletes it once the task moves on."""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.delivery.retention import sweep_payloads
from strawq.errors import LeaseLost
from strawq.ondisk.names import data_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing import audit_run, make_group
from tests.strawq.queue_helpers import clobber, make_feeder, make_queue
from tests.strawq.test_meta_ops import CountingStorage


def _leases(q: RunQueue, tmp_path: Path, n: int) -> list[Lease]:
    make_feeder(q, tmp_path, n).release(n)
    return q.claim("p", n)


def _torn(q: RunQueue, lease: Lease, suffix: str = "group") -> bytes:
    """The first half of the lease's payload at its key, as a crash mid-write leaves it."""
    kind = Kind.GROUP if suffix == "group" else Kind.PARTIAL
    blob = b"".join(make_group(lease.task_id, 1).encode(kind, run_format=q.formats.get()))
    q.storage.publish(data_key(lease.task_id, lease.gen, suffix), blob[:len(blob) // 2],
                      in_place=True)
    return blob


def test_a_complete_makes_one_rename_the_fencing_one(tmp_path: Path) -> None:
    """Before, the payload's own publish renamed a temporary file into ``data/`` too: on
    JuiceFS a Rename, two GetAttr and a Lookup a group."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st)
    done, parked = _leases(q, tmp_path, 2)
    st.ops.clear()
    q.complete(done, make_group(done.task_id, 1))
    assert st.ops["rename"] == 1 and st.ops["create tmp"] == 0, st.ops
    assert st.ops["create in place"] == 1, st.ops
    st.ops.clear()
    q.yield_partial(parked, make_group(parked.task_id, 2))
    assert st.ops["rename"] == 1 and st.ops["create tmp"] == 0, st.ops
    assert q.read_group(done.task_id, done.gen).task_id == done.task_id


def test_a_payload_cut_off_mid_write_is_written_again_by_its_holder(
        storage: Storage, tmp_path: Path) -> None:
    """The holder's earlier attempt died mid-write (a retried call, a lease its restarted
    producer recovered): the file is there, half written. Taking it as the payload (what a
    temporary file and its rename made safe) would commit a torn group."""
    q = make_queue(storage)
    (lease,) = _leases(q, tmp_path, 1)
    _torn(q, lease)
    group = make_group(lease.task_id, 1)
    q.complete(lease, group)
    got = q.read_group(lease.task_id, lease.gen)
    assert got.task_id == lease.task_id and got.num_samples == group.num_samples
    assert audit_run(storage).check([lease.task_id]) == []


def test_a_fenced_holder_neither_commits_nor_leaves_its_payload(storage: Storage,
                                                                tmp_path: Path) -> None:
    q = make_queue(storage)
    (lease,) = _leases(q, tmp_path, 1)
    q.release(lease)  # the task moved on (gen + 1), as an expiry moves it
    with pytest.raises(LeaseLost):
        q.complete(lease, make_group(lease.task_id, 1))
    assert not storage.exists(data_key(lease.task_id, lease.gen, "group"))
    # a torn file of the old generation: a fenced holder that finds it leaves it, swept
    _torn(q, lease)
    with pytest.raises(LeaseLost):
        q.complete(lease, make_group(lease.task_id, 1))
    assert sweep_payloads(storage) == 1
    assert audit_run(storage).check([lease.task_id]) == []


def test_the_audit_tells_a_payload_cut_off_from_a_torn_committed_one(
        storage: Storage, tmp_path: Path) -> None:
    """A partial payload no entry names is crash debris (``uncommitted``); the same bytes
    under a committed group are a torn record, a problem. The sweep deletes the debris
    once the task has moved on."""
    q = make_queue(storage)
    held, done = _leases(q, tmp_path, 2)
    _torn(q, held)
    q.complete(done, make_group(done.task_id, 2))
    a = audit_run(storage)
    key = data_key(held.task_id, held.gen, "group")
    assert [k for k, _ in a.uncommitted] == [key]
    assert a.check([held.task_id, done.task_id]) == []
    assert sweep_payloads(storage) == 0  # its lease still holds generation gen
    q.release(held)
    assert sweep_payloads(storage) == 1 and not storage.exists(key)
    committed = data_key(done.task_id, done.gen, "group")
    clobber(storage, committed, storage.read(committed)[:40])
    problems = audit_run(storage).check([held.task_id, done.task_id])
    assert any("torn or corrupt record visible" in p and committed in p
               for p in problems), problems
