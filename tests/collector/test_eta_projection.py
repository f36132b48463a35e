"""The η projection counts what was trained (finding: off by one in either direction with
the order of weight update, checkpoint and ack): a batch the trainer was delivered is
trained on the version current at its delivery and its gradient is in every later version,
acked or not; a batch the weights do not hold yet is ahead, acked or not. So a group within
η is never dropped or regenerated for a batch already trained, and a group over η is never
planned one version early."""

from __future__ import annotations

import itertools

import pytest

from strawq.collector.admission import admission, progress
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.storage import MemoryStorage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import Depths
from tests.collector.test_ordering import N, _group, dataset  # noqa: F401 - fixture

#: every order a trainer may use after the optimizer step; ``ckpt`` commits nothing here
ORDERS = [tuple(p) for p in itertools.permutations(("update", "ckpt", "ack"))]


def _setup(ds, **cfg: object) -> tuple[RunQueue, Collector, BatchReader]:
    q = RunQueue.create(MemoryStorage(), QueueConfig(release_batch=N, fsync=False))
    base = {"batch_groups": 2, "max_running": N, "max_ready": N, "max_prefetch_batches": 2,
            "poll_interval_s": 0.0, "gc_interval_s": 0.0, "flush_at_end": False,
            "max_staleness": 1, "eta_mode": "drop"}
    base.update(cfg)
    col = Collector(q, ds, CollectorConfig(**base))  # type: ignore[arg-type]
    col.start(wait=False)
    col.step()  # releases the dataset
    return q, col, BatchReader(q, poll_interval_s=0.0)


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_a_trained_batch_is_not_ahead_whatever_the_order(dataset, order):  # noqa: F811
    q, col, reader = _setup(dataset)
    leases = {x.task_id: x for x in q.claim("p", N)}
    for i in (0, 1):
        q.complete(leases[f"i{i:012d}"], _group(leases.pop(f"i{i:012d}"), 0))
    (seq,) = col.step().published
    batch = reader.next_batch(timeout=1)  # delivered at version 0: trained on it
    assert batch.seq == seq and batch.version == 0
    # two groups at version 0: trained at version 1 (after this batch's update), staleness
    # 1 <= eta = 1. Stepping the collector between any two of the trainer's actions must
    # never drop them.
    for i in (2, 3):
        q.complete(leases[f"i{i:012d}"], _group(leases.pop(f"i{i:012d}"), 0))
    for action in order:
        if action == "update":
            q.set_version(1)
        elif action == "ack":
            reader.ack(batch)
        rep = col.step()
        assert rep.dropped_stale == [], (order, action)
        for s in rep.published:
            assert col.batches.read_manifest(s).meta["trained_at"] == 1, (order, action)
    assert q.storage.list("dropped") == []
    nxt = reader.next_batch(timeout=1)
    assert nxt.version == 1 and {s["index"] for s in nxt.summaries} == {2, 3}
    assert col.batches.read_manifest(nxt.seq).meta["trained_at"] == nxt.version


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_the_plan_is_the_version_the_trainer_reads_at(dataset, order):  # noqa: F811
    """η = 0: a batch formed while the previous one is in training is trained one version
    later; acked before the update, it still counts (so nothing over η is planned early)."""
    q, col, reader = _setup(dataset, max_staleness=None, eta_mode="train")
    leases = {x.task_id: x for x in q.claim("p", N)}
    for i in (0, 1):
        q.complete(leases[f"i{i:012d}"], _group(leases.pop(f"i{i:012d}"), 0))
    col.step()
    batch = reader.next_batch(timeout=1)
    planned = []
    for n, action in enumerate(order):
        if action == "update":
            q.set_version(1)
        elif action == "ack":
            reader.ack(batch)
        i = 2 + 2 * n
        for j in (i, i + 1):
            q.complete(leases[f"i{j:012d}"], _group(leases.pop(f"i{j:012d}"), 0))
        planned += [col.batches.read_manifest(s).meta["trained_at"] for s in col.step().published]
    assert planned and all(p == 1 for p in planned[:1]), (order, planned)
    got = reader.next_batch(timeout=1)
    assert col.batches.read_manifest(got.seq).meta["trained_at"] == got.version == 1


def test_progress_counts_delivery_not_acks():
    # batch 1 delivered at v0 and acked, batch 2 delivered at v0 unacked, batch 3 waiting,
    # batch 4 refused; the current version is 0, then 1
    marks = {1: 0, 2: 0}
    at0 = progress(0, [1, 2, 3, 4], {1}, marks, refused={4}, batches_per_version=2)
    assert (at0.in_training, at0.waiting, at0.ahead) == (2, 1, 3)
    assert at0.consumed == frozenset() and at0.training == {1, 2}
    at1 = progress(1, [1, 2, 3, 4], {1}, marks, refused={4}, batches_per_version=2)
    assert (at1.in_training, at1.waiting) == (0, 1) and at1.consumed == {1, 2}
    # no delivery marks at all (a consumer that does not mark): acked is consumed
    legacy = progress(0, [1, 2], {1}, {})
    assert legacy.consumed == {1} and legacy.waiting == 1 and legacy.in_training == 0
    # a retired batch delivered at the current version is still in training
    assert progress(0, [], set(), {7: 0}).in_training == 1
    # a trainer that never updates: no more than one version's batches wait for an update
    never = progress(0, [1, 2, 3], {1, 2, 3}, {1: 0, 2: 0, 3: 0}, batches_per_version=1)
    assert never.in_training == 1 and never.training == {1, 2, 3}


def test_admission_keeps_room_for_the_batch_in_training():
    # eta = 1, B = 4, u = 1: window 8 groups; one batch being trained at the current version
    # (acked or not) still takes 4 of them until the update
    d = Depths(ready=0, batched=0, pending=0, partial=0, leased=0)
    free = admission(d, batch_groups=4, max_staleness=1, max_running=99, max_ready=99)
    busy = admission(d, batch_groups=4, max_staleness=1, max_running=99, max_ready=99,
                     in_training=1)
    assert (free.capacity, busy.capacity) == (8, 4)
