"""Staleness-first order (FIFO by first observation on ties) and the η bound, under
randomized completion orders and weight versions (Hypothesis), on the real queue API."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.ondisk.groups import GroupData
from strawq.delivery.batches import BatchStore
from strawq.ondisk.names import TaskName
from strawq.storage import MemoryStorage
from strawq.tasks.eta import STALE_REASON
from strawq.tasks.queue import Lease, RunQueue
from tests.collector.helpers import write_dataset

N = 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return Dataset(write_dataset(str(tmp_path_factory.mktemp("ds") / "ds.jsonl"), N))


def _group(lease: Lease, version: int) -> GroupData:
    n = 3
    return GroupData(task_id=lease.task_id, index=int(lease.task["index"]),
                     prompt_ids=np.asarray(lease.task["row"]["prompt"], dtype=np.int32),
                     sample_lens=[n, n], tokens=np.arange(2 * n, dtype=np.int32),
                     logprobs=np.zeros(2 * n, dtype=np.float32),
                     versions=np.full(2 * n, version, dtype=np.int64),
                     loss_mask=np.ones(2 * n, dtype=np.uint8), rewards=[0.0, 1.0],
                     status=["completed", "completed"])


def _setup(dataset: Dataset, **cfg: object) -> tuple[RunQueue, Collector]:
    q = RunQueue.create(MemoryStorage(), QueueConfig(release_batch=N, fsync=False))
    base = {"batch_groups": 3, "max_running": N, "max_ready": N, "max_prefetch_batches": 100,
            "poll_interval_s": 0.0, "gc_interval_s": 0.0, "flush_at_end": False,
            "max_staleness": None}  # the order itself: no admission bound
    base.update(cfg)
    col = Collector(q, dataset, CollectorConfig(**base))  # type: ignore[arg-type]
    col.start(wait=False)
    return q, col


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(data=st.data(), eta=st.one_of(st.none(), st.integers(0, 2)),
       mode=st.sampled_from(["drop", "requeue"]))
@pytest.mark.slow
def test_staleness_first_fifo_and_eta_bound(dataset, data, eta, mode):
    q, col = _setup(dataset, max_staleness=eta, eta_mode=mode)
    leases: dict[str, Lease] = {}
    observed: dict[str, tuple[int, int]] = {}   # task id -> (step first seen ready, index)
    published: list[tuple[int, list[TaskName], int]] = []
    completed_versions: dict[str, int] = {}
    for step in range(40):
        for n in [TaskName.parse(x) for x in q.storage.list("ready")]:
            observed.setdefault(n.id, (step, int(n.id[1:])))
        rep = col.step()
        for tid in rep.requeued_stale + rep.dropped_stale:
            observed.pop(tid, None)
        # batches published in this pass: groups in staleness-first, first-observation order
        for seq in rep.published:
            man = col.batches.read_manifest(seq)
            published.append((seq, man.groups, rep.version))
            keys = [(n.version, observed[n.id]) for n in man.groups]
            assert keys == sorted(keys), f"batch {seq} out of order: {keys}"
            # a batched group's entry stays in ready/: what is left is what no batch names
            remaining = BatchStore(q).scan_ready()
            if remaining:
                oldest = min((n.version, observed[n.id]) for n in remaining)
                assert max(keys) <= oldest, "a batch skipped an older ready group"
            for n in man.groups:
                # generated max_attempts times, a group is trained with its correction, not
                # regenerated again (``requeue`` is ``regenerate``: the cap applies to both
                # names; a regeneration spends no failure attempt, so generations count)
                if eta is not None and n.regenerations + 1 < q.config.max_attempts:
                    assert rep.version - n.version <= eta, "a group staler than eta trained"
            col.batches.ack(seq)
        # the producers: claim what is pending, complete a random subset at random versions
        for lease in q.claim("p", N):
            leases[lease.task_id] = lease
        if leases:
            ids = data.draw(st.lists(st.sampled_from(sorted(leases)), unique=True, max_size=6))
            v = q.current_version()
            for tid in ids:
                ver = data.draw(st.integers(max(v - 3, 0), v))
                q.complete(leases[tid], _group(leases[tid], ver))
                completed_versions[tid] = ver
                del leases[tid]
        if data.draw(st.booleans()):
            q.set_version(q.current_version() + 1)
    # every group trained at most once; every stale drop is recorded with the reason
    trained = [n.id for _s, groups, _v in published for n in groups]
    assert len(trained) == len(set(trained))
    dropped = [TaskName.parse(x) for x in q.storage.list("dropped")]
    assert all(d.producer == STALE_REASON for d in dropped)
    if eta is None or mode == "requeue":
        assert not dropped
    assert not set(trained) & {d.id for d in dropped}


@pytest.mark.timeout(30)
def test_fifo_on_ties_is_first_observation_not_dataset_order(dataset):
    q, col = _setup(dataset, batch_groups=2)
    col.step()  # releases everything
    leases = {lease.task_id: lease for lease in q.claim("p", N)}
    # i5 finishes first, then (a pass later) i1: same version, i5 must come first
    q.complete(leases["i000000000005"], _group(leases["i000000000005"], 0))
    col.step()
    q.complete(leases["i000000000001"], _group(leases["i000000000001"], 0))
    rep = col.step()
    man = col.batches.read_manifest(rep.published[0])
    assert [n.id for n in man.groups] == ["i000000000005", "i000000000001"]


@pytest.mark.timeout(30)
def test_older_version_overtakes_fifo(dataset):
    q, col = _setup(dataset, batch_groups=2)
    col.step()
    leases = {lease.task_id: lease for lease in q.claim("p", N)}
    q.set_version(2)
    q.complete(leases["i000000000003"], _group(leases["i000000000003"], 2))
    assert not col.step().published
    q.complete(leases["i000000000007"], _group(leases["i000000000007"], 0))
    rep = col.step()
    man = col.batches.read_manifest(rep.published[-1])
    assert [n.id for n in man.groups] == ["i000000000007", "i000000000003"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["drop", "requeue"])
def test_eta_bound_modes(dataset, mode):
    q, col = _setup(dataset, batch_groups=2, max_staleness=1, eta_mode=mode)
    col.step()
    leases = {lease.task_id: lease for lease in q.claim("p", N)}
    q.complete(leases["i000000000000"], _group(leases["i000000000000"], 0))
    q.set_version(2)
    rep = col.step()
    if mode == "drop":
        assert rep.dropped_stale == ["i000000000000"]
        state, name = q.find("i000000000000")
        assert state == "dropped" and name.producer == STALE_REASON
        note = q.storage.read(f"data/i000000000000~g0.drop.{STALE_REASON}")
        assert b"staleness 2 > eta 1" in note
    else:
        assert rep.requeued_stale == ["i000000000000"]
        state, name = q.find("i000000000000")
        assert state == "pending" and name.gen == 1 and name.resume == -1
        assert not q.storage.exists("data/i000000000000~g0.group")
