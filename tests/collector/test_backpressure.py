"""Admission: a slow trainer turns into waiting producers, never an unbounded queue."""

from __future__ import annotations

import pytest

from strawq.collector.admission import Depths, admission
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from strawq.delivery.commits import commit
from strawq.errors import ConfigError
from tests.collector.helpers import SimProducer, make_run, write_dataset


def test_admission_formula_example():
    # η = 2, B = 4, u = 1: at most (2 + 1)·4 = 12 groups untrained or running
    d = Depths(pending=2, partial=1, leased=3, ready=2, batched=2)
    a = admission(d, batch_groups=4, max_staleness=2, max_running=100, max_ready=100)
    assert (a.capacity, a.limited_by, a.eta_room) == (2, "eta", 2)
    a = admission(d, batch_groups=4, max_staleness=None, max_running=8, max_ready=100)
    assert (a.capacity, a.limited_by) == (2, "running")
    a = admission(d, batch_groups=4, max_staleness=None, max_running=100, max_ready=4)
    assert (a.capacity, a.running_room, a.backlog_room) == (94, 94, 96)
    full = Depths(ready=50, leased=6)
    a = admission(full, batch_groups=4, max_staleness=None, max_running=8, max_ready=40)
    assert (a.capacity, a.limited_by) == (0, "backlog")
    a = admission(Depths(ready=20), batch_groups=4, max_staleness=0, max_running=8,
                  max_ready=40)
    assert a.capacity == 0  # never negative


@pytest.mark.timeout(90)
@pytest.mark.parametrize("eta", [None, 1])
def test_slow_trainer_keeps_everything_bounded(tmp_path, eta):
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 200))
    cfg = CollectorConfig(batch_groups=4, max_running=6, max_ready=8, max_prefetch_batches=2,
                          max_staleness=eta, eta_mode="off", poll_interval_s=0,
                          gc_interval_s=0)
    col = Collector(q, ds, cfg)
    col.start(wait=False)
    prods = [SimProducer(q, f"p{i}", seed=i, slots=4, chunk=5) for i in range(3)]
    acked = 0
    for step in range(150):
        rep = col.step()
        d = col.depths()
        seqs, done = col.batches.batch_seqs()
        unacked = [s for s in seqs if s not in done]
        assert d.running <= cfg.max_running, d
        assert d.ready + d.running <= cfg.max_running + cfg.max_ready, d
        assert len(unacked) <= cfg.max_prefetch_batches
        if eta is not None:
            assert d.untrained + d.running <= (eta + 1) * cfg.batch_groups, d
        for p in prods:
            p.step()
        if step % 10 == 9 and unacked:  # the trainer takes one batch every 10 passes
            col.batches.ack(unacked[0])
            acked += 1
            q.set_version(q.current_version() + 1)
    assert acked >= 10
    # producers wait for work (the cursor stopped far from the end)
    assert col.feeder is not None and col.feeder.cursor.next_index < 200
    assert rep.admission is not None


@pytest.mark.timeout(60)
def test_filtered_groups_free_capacity_at_once(tmp_path):
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 100))
    cfg = CollectorConfig(batch_groups=4, max_running=4, max_ready=4, max_staleness=0,
                          eta_mode="off", poll_interval_s=0)
    col = Collector(q, ds, cfg)
    col.start(wait=False)
    col.step()
    assert col.depths().pending == 4
    leases = q.claim("p", 4)
    for lease in leases[:3]:
        q.drop(lease, "zero_variance", "all rewards equal")
    rep = col.step()
    assert rep.released == 3  # the three filtered groups' capacity, at once
    assert col.dropped_by_reason() == {"zero_variance": 3}


def test_admission_window_in_batches():
    # flow's window for eta = 1 and m = 4 micro-batches of 24: eta·m + 1 = 5 batches = 120
    d = Depths(pending=10, leased=60, ready=20, batched=24)
    a = admission(d, batch_groups=24, max_staleness=1, batches_per_version=4, max_running=999,
                  max_ready=999, window=5)
    assert (a.capacity, a.limited_by, a.eta_room) == (6, "eta", 6)
    # None: the default (eta + 1)·u batches = 192
    a = admission(d, batch_groups=24, max_staleness=1, batches_per_version=4, max_running=999,
                  max_ready=999)
    assert a.eta_room == 192 - 114
    # a fractional window rounds down: 5.5 · 24 = 132 groups
    a = admission(d, batch_groups=24, max_staleness=1, batches_per_version=4, max_running=999,
                  max_ready=999, window=5.5)
    assert a.eta_room == 132 - 114
    # no eta bound: the window is ignored
    a = admission(d, batch_groups=24, max_staleness=None, max_running=200, max_ready=999,
                  window=1)
    assert (a.eta_room, a.limited_by) == (None, "running")


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("nan"), float("inf")])
def test_admission_window_validated(bad):
    with pytest.raises(ConfigError, match="admission_batches"):
        CollectorConfig(admission_batches=bad)
    CollectorConfig(admission_batches=1)
    CollectorConfig(admission_batches=4.5)


@pytest.mark.timeout(60)
def test_acked_batch_frees_room_before_gc(tmp_path):
    """A trainer that acks a batch but has not committed the checkpoint covering it yet: GC
    keeps its groups on disk (batched), and admission counts them as trained all the same."""
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 100))
    cfg = CollectorConfig(batch_groups=4, max_running=8, max_ready=8, max_staleness=0,
                          eta_mode="off", poll_interval_s=0, gc_interval_s=0)
    col = Collector(q, ds, cfg)
    col.start(wait=False)
    commit(q.storage, 0)  # a checkpointing trainer: GC waits for its commits
    prod = SimProducer(q, "p", slots=4, chunk=50)
    published: list[int] = []
    for _ in range(50):
        published += col.step().published
        if published:
            break
        prod.step()
    assert published, "no batch formed"
    rep = col.step()
    assert rep.released == 0 and rep.depths.batched == 4  # eta = 0: one batch in flight
    col.batches.ack(published[0])
    rep = col.step()
    assert col.depths().batched == 4  # not collected: no commit covers it
    assert rep.released == 4  # but consumed: its room is free
    commit(q.storage, published[0])
    col.step()
    assert col.depths().batched == 0
    assert col.consumed.count(*col.batches.batch_seqs()) == 0
