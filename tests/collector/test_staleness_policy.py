"""The η policy (docs/design.md, invariant 10): nothing is dropped for staleness unless configured;
the bound is judged at the version a group is trained at (prefetched batches counted);
``regenerate`` counts an attempt and draws fresh seeds."""

from __future__ import annotations

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.config import QueueConfig
from strawq.errors import ConfigError
from strawq.producers.group import sample_seed
from strawq.storage import MemoryStorage
from strawq.tasks.queue import RunQueue
from tests.collector.test_ordering import N, _group, dataset  # noqa: F401 - fixture


def _setup(ds, **cfg: object) -> tuple[RunQueue, Collector]:
    q = RunQueue.create(MemoryStorage(), QueueConfig(release_batch=N, fsync=False))
    base = {"batch_groups": 2, "max_running": N, "max_ready": N, "max_prefetch_batches": 1,
            "poll_interval_s": 0.0, "gc_interval_s": 0.0, "flush_at_end": False,
            "max_staleness": 1}
    base.update(cfg)
    col = Collector(q, ds, CollectorConfig(**base))  # type: ignore[arg-type]
    col.start(wait=False)
    return q, col


def test_default_policy_keeps_and_counts(dataset):  # noqa: F811
    """``train`` (the soft mode; the default is ``hard``, tests/collector/test_hard_eta.py)
    keeps a group over η, trains it and counts it."""
    assert CollectorConfig().eta_mode == "hard"
    q, col = _setup(dataset, eta_mode="train")
    col.step()
    leases = {lease.task_id: lease for lease in q.claim("p", N)}
    q.complete(leases["i000000000000"], _group(leases["i000000000000"], 0))
    q.complete(leases["i000000000001"], _group(leases["i000000000001"], 3))
    q.set_version(3)
    rep = col.step()
    assert rep.dropped_stale == [] and rep.requeued_stale == []
    assert rep.stale_trained == ["i000000000000"]
    man = col.batches.read_manifest(rep.published[0])
    assert [n.id for n in man.groups] == ["i000000000000", "i000000000001"]
    assert man.meta["over_eta"] == ["i000000000000"]
    assert (man.meta["max_staleness"], man.meta["eta_mode"]) == (1, "train")
    assert col.stale_totals == {"trained": 1, "regenerated": 0, "dropped": 0}
    assert q.storage.list("dropped") == []


def test_prefetched_batches_count_toward_the_bound(dataset):  # noqa: F811
    # the second batch is trained one version after the first: a group at staleness 1 now
    # is at 2 when trained, over eta = 1
    q, col = _setup(dataset, eta_mode="drop", max_prefetch_batches=2)
    col.step()
    leases = {lease.task_id: lease for lease in q.claim("p", N)}
    for i, v in ((0, 1), (1, 1), (2, 0), (3, 1)):
        tid = f"i{i:012d}"
        q.complete(leases[tid], _group(leases[tid], v))
    q.set_version(1)
    # staleness-first: i2 (v0) and i0 form batch 1 (trained at 1), i1 and i3 batch 2 (at 2)
    rep = col.step()
    assert rep.dropped_stale == [] and len(rep.published) == 2
    first = col.batches.read_manifest(rep.published[0])
    assert first.meta["trained_at"] == 1
    assert col.batches.read_manifest(rep.published[1]).meta["trained_at"] == 2
    # now one batch is unacked: a v0 group is trained at version >= 2, staleness 2 > 1
    q2, col2 = _setup(dataset, eta_mode="drop", max_prefetch_batches=2)
    col2.step()
    leases = {lease.task_id: lease for lease in q2.claim("p", N)}
    for i in (0, 1):
        q2.complete(leases[f"i{i:012d}"], _group(leases[f"i{i:012d}"], 1))
    q2.set_version(1)
    assert len(col2.step().published) == 1  # unacked: trained at 1
    for i in (2, 3):
        q2.complete(leases[f"i{i:012d}"], _group(leases[f"i{i:012d}"], 0))
    rep = col2.step()
    assert sorted(rep.dropped_stale) == ["i000000000002", "i000000000003"]


def test_regenerate_counts_a_regeneration_and_draws_fresh_seeds(dataset):  # noqa: F811
    q, col = _setup(dataset, eta_mode="regenerate")
    col.step()
    leases = {lease.task_id: lease for lease in q.claim("p", N)}
    lease = leases["i000000000000"]
    assert lease.name.attempts == 1
    q.complete(lease, _group(lease, 0))
    q.set_version(2)
    rep = col.step()
    assert rep.requeued_stale == ["i000000000000"]
    state, name = q.find("i000000000000")
    # the attempt refunded (a regeneration is not a failure), the regeneration counted
    assert state == "pending" and name.gen == 1 and name.attempts == 0
    assert name.regenerations == 1
    assert col.stale_totals["regenerated"] == 1
    # a group generated from scratch at generation 1 samples with other seeds than at 0
    assert sample_seed(7, 0, 3, name.gen) != sample_seed(7, 0, 3)
    assert sample_seed(7, 0, 3, 0) == sample_seed(7, 0, 3)


def test_regenerate_stops_at_max_attempts_and_trains_the_group(dataset):  # noqa: F811
    # a prompt whose responses keep running past eta must not cycle for ever: once its
    # regenerations reach the cap the group is kept and trained with its correction, and counted
    q, col = _setup(dataset, eta_mode="regenerate")
    col.step()
    max_attempts = q.config.max_attempts
    first = {x.task_id: x for x in q.claim("p", N)}
    lease = first["i000000000000"]
    version = 0
    for attempt in range(1, max_attempts + 1):
        assert lease.name.attempts == 1 and lease.name.regenerations == attempt - 1
        q.complete(lease, _group(lease, version))
        version += 2
        q.set_version(version)
        if attempt == max_attempts:  # a fresh partner, so a batch of two forms
            partner = first["i000000000001"]
            q.complete(partner, _group(partner, version))
        rep = col.step()
        if attempt < max_attempts:
            assert rep.requeued_stale == ["i000000000000"], attempt
            (lease,) = q.claim("p", 1)
    assert rep.requeued_stale == [] and rep.dropped_stale == []
    assert "i000000000000" in rep.stale_trained
    assert col.stale_totals["regenerated"] == max_attempts - 1
    state, _name = q.find("i000000000000")
    assert state in ("ready", "batched")


def test_unknown_policy_refused():
    with pytest.raises(ConfigError, match="eta_mode"):
        CollectorConfig(eta_mode="ignore")  # type: ignore[arg-type]
