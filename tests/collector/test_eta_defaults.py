"""Defaults a user can train with: η is bounded by default, and the default admission
window keeps every trained group within it without dropping or regenerating anything,
whatever the order in which the trainer acks and updates the weights."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.storage import MemoryStorage
from strawq.tasks.eta import DEFAULT_MAX_STALENESS, read_policy
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import SimProducer, make_run, write_dataset
from tests.collector.test_ordering import N, _group


def test_the_default_bound_is_published():
    cfg = CollectorConfig()
    assert cfg.max_staleness == DEFAULT_MAX_STALENESS == 1
    assert cfg.eta_mode == "hard" and cfg.admission_batches is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", [("ack", "update"), ("update", "ack")], ids="-".join)
def test_defaults_keep_trained_staleness_within_eta(tmp_path, order, caplog):
    q = make_run(str(tmp_path / "run"), release_batch=16)
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 400))
    # only the sizes of this small test are set; every eta/admission setting is the default
    cfg = CollectorConfig(batch_groups=4, poll_interval_s=0, gc_interval_s=0,
                          metrics_interval_s=1e9)
    col = Collector(q, ds, cfg)
    col.start(wait=False)
    assert read_policy(q.storage).max_staleness == cfg.max_staleness
    prods = [SimProducer(q, f"p{i}", slots=8, seed=i, chunk=20, max_new=(1, 12))
             for i in range(2)]
    reader = BatchReader(q, poll_interval_s=0.0)
    stale: list[int] = []
    over = 0
    with caplog.at_level(logging.WARNING, logger="strawq.collector.batching"):
        for _ in range(400):
            col.step()
            for p in prods:
                p.step()
            seqs, acked = col.batches.batch_seqs()
            if not any(s not in acked for s in seqs):
                continue
            b = reader.next_batch(timeout=1)
            stale += (b.version - b.sample_min_version.numpy()).tolist()
            over += int(np.asarray(b.over_eta).sum())
            for action in order:  # the trainer's order after its optimizer step
                if action == "ack":
                    reader.ack(b)
                else:
                    q.set_version(q.current_version() + 1)
            if q.current_version() >= 25:
                break
    assert q.current_version() >= 25, "the run did not train 25 steps"
    assert max(stale) <= DEFAULT_MAX_STALENESS, f"trained staleness up to {max(stale)}"
    assert over == 0 and col.stale_totals == {"trained": 0, "regenerated": 0, "dropped": 0}
    assert q.storage.list("dropped") == []
    assert not [r for r in caplog.records if "over eta" in r.getMessage()]


def _ready_one_over_eta(tmp_path: Path) -> tuple[RunQueue, Collector]:
    """A run at version 3 with two ready groups, of versions 0 (over η = 1) and 3, under the
    soft mode (the hard one holds the batch for the groups still leased since version 0)."""
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), N))
    q = RunQueue.create(MemoryStorage(), QueueConfig(release_batch=N, fsync=False))
    col = Collector(q, ds, CollectorConfig(batch_groups=2, max_running=N, max_ready=N,
                                           poll_interval_s=0, gc_interval_s=0,
                                           eta_mode="train"))
    col.start(wait=False)
    col.step()
    leases = {x.task_id: x for x in q.claim("p", N)}
    for i, v in ((0, 0), (1, 3)):
        q.complete(leases[f"i{i:012d}"], _group(leases[f"i{i:012d}"], v))
    q.set_version(3)
    return q, col


def test_a_group_over_eta_is_not_trained_silently(tmp_path, caplog):
    """A group that runs past η under the soft ``train`` mode is trained with its
    correction, named in the manifest and logged as a warning."""
    q, col = _ready_one_over_eta(tmp_path)
    with caplog.at_level(logging.WARNING, logger="strawq.collector.batching"):
        rep = col.step()
    assert rep.stale_trained == ["i000000000000"]
    assert any("over eta 1" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_the_default_mode_trains_past_eta_and_the_reader_shows_by_how_much(
        tmp_path: Path) -> None:
    """Under the soft mode (``eta_mode=train``; the default is ``hard``) η bounds what
    admission releases, not what is trained: a group that
    ran past η is trained, the reader's ``staleness/max`` is over η and
    ``staleness/over_eta_frac`` gives the share of the batch's samples past it. The docs
    say so where they explain ``staleness/max`` (operations' metrics table, the
    quickstart's demo summary), and no longer that it stays within η."""
    q, col = _ready_one_over_eta(tmp_path)
    assert col.step().stale_trained == ["i000000000000"]
    b = BatchReader(q).next_batch(timeout=5)
    assert col.config.max_staleness == 1 and col.config.eta_mode == "train"
    assert b.stats["staleness/max"] == 3.0
    assert b.stats["staleness/over_eta_frac"] == 0.5  # 2 of the batch's 4 samples
    docs = Path(__file__).resolve().parents[2] / "docs"
    row = next(line for line in (docs / "operations.md").read_text().splitlines()
               if line.startswith("| `staleness/mean`"))
    assert "`max` ≤ η when a bound is set" not in row
    for needle in ("staleness/over_eta_frac", "collector/stale_trained_total", "`train`",
                   "`regenerate`", "`drop`", "`off`"):
        assert needle in row, needle
    quickstart = (docs / "quickstart.md").read_text()
    assert "staleness/over_eta_frac" in quickstart and "eta_mode=train" in quickstart
