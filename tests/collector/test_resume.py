"""The three resume paths: queue intact / cursor only / nothing — with their warnings."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from tests.collector.helpers import SimProducer, drive, write_dataset

CFG = CollectorConfig(batch_groups=4, max_running=8, max_ready=8, max_prefetch_batches=1,
                      poll_interval_s=0, gc_interval_s=0, takeover_timeout_s=0.05)
QCFG = QueueConfig(fsync=False, lease_timeout_s=2.0, heartbeat_interval_s=0.2,
                   release_batch=4)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def started(tmp_path):
    run = str(tmp_path / "run")
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 40))
    col = Collector.open(run, ds, CFG, queue_config=QCFG, fsync=False)
    assert col.resume_info is not None and col.resume_info.path == "new"
    prods = [SimProducer(col.queue, "p0", seed=1, chunk=2, max_new=(4, 12))]
    reader = BatchReader(col.queue)
    for _ in range(30):
        drive(col, prods, 1)
        if col.batches.batch_seqs()[0]:
            break
    b = reader.next_batch(timeout=5)
    reader.ack(b)
    col.queue.set_version(3)
    drive(col, prods, 4)
    prods[0].yield_all()  # the producer stops: its groups become partials
    drive(col, [], 1)
    return run, ds, col, reader


@pytest.mark.timeout(60)
def test_queue_intact_keeps_pending_partial_and_ready(started, caplog):
    run, ds, col, reader = started
    ckpt = reader.state_dict()
    before = col.depths()
    ready_before = set(col.storage.list("ready")) | set(col.storage.list("batched"))
    assert before.partial + before.pending > 0 and ready_before
    # the collector dies (no close); a new one takes over after the takeover timeout
    caplog.clear()
    col2 = Collector.open(run, ds, CFG, checkpoint=ckpt, fsync=False)
    assert col2.resume_info.path == "queue"
    assert col2.fence.epoch == 2
    after = col2.depths()
    assert (after.pending, after.partial, after.ready + after.batched) == \
        (before.pending, before.partial, before.ready + before.batched)
    assert ready_before <= set(col2.storage.list("ready")) | set(col2.storage.list("batched"))
    assert col2.feeder.cursor.next_index == col.feeder.cursor.next_index
    assert col2.queue.current_version() == 3
    assert not [w for w in _warnings(caplog) if "checkpoint" in w]
    # a restarted trainer continues after the acked batch and nothing is regenerated
    p = SimProducer(col2.queue, "p1", seed=5)
    r2 = BatchReader(col2.queue)
    r2.load_state_dict(ckpt)
    seen = []
    for _ in range(200):
        rep = col2.step()
        p.step()
        seqs, acked = col2.batches.batch_seqs()
        if any(s not in acked for s in seqs):
            b = r2.next_batch(timeout=5)
            seen += [s["index"] for s in b.summaries]
            r2.ack(b)
        if rep.drained:
            break
    assert rep.drained
    first = [s["index"] for s in col.batches.read_manifest(1).summaries] \
        if col.storage.exists("batches/000000000001") else []
    assert len(seen) == len(set(seen)) and not set(seen) & set(first)
    assert len(set(p.completed) & {n.split("~")[1] for n in ready_before}) == 0


@pytest.mark.timeout(60)
def test_cursor_only_resumes_at_the_checkpoint(started, caplog):
    run, ds, col, reader = started
    ckpt = reader.state_dict()
    assert ckpt["feeder"]["next_index"] > 0 and ckpt["batch_seq"] == 1
    col.close()
    shutil.rmtree(run)
    caplog.clear()
    col2 = Collector.open(run, ds, CFG, queue_config=QCFG, checkpoint=ckpt, fsync=False)
    assert col2.resume_info.path == "cursor"
    assert any("resuming from the checkpoint's dataset cursor" in w
               for w in _warnings(caplog))
    assert col2.feeder.cursor.next_index == ckpt["feeder"]["next_index"]
    assert col2.queue.current_version() == ckpt["version"]
    # the prompts in flight at the checkpoint are queued again; new ones follow the cursor
    queued = sorted(int(k.rsplit("/", 1)[1].split("~")[0].split(".")[1])
                    for k in col2.queue.list_pending())
    assert queued == ckpt["feeder"]["in_flight"] and queued
    assert all(i < ckpt["feeder"]["next_index"] for i in queued)
    assert col2.batches.next_seq() == 2  # batch numbers continue after the checkpoint's


@pytest.mark.timeout(60)
def test_unreadable_queue_and_no_cursor_starts_at_zero(started, caplog):
    run, ds, col, _reader = started
    col.close()
    with open(os.path.join(run, "run.meta"), "r+b") as f:
        f.write(b"garbage!")
    caplog.clear()
    col2 = Collector.open(run, ds, CFG, queue_config=QCFG, checkpoint={"version": 3},
                          fsync=False)
    assert col2.resume_info.path == "fresh"
    msgs = _warnings(caplog)
    assert any("unreadable" in w and "moved it to" in w for w in msgs)
    assert any("starting from the dataset's beginning" in w for w in msgs)
    assert [d for d in os.listdir(os.path.dirname(run)) if ".unreadable-" in d]
    rep = col2.step()
    assert rep.released > 0 and col2.feeder.cursor.next_index == rep.released
    assert col2.queue.current_version() == 3


@pytest.mark.timeout(60)
def test_missing_queue_no_checkpoint_cursor_warns(tmp_path, caplog):
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 8))
    col = Collector.open(str(tmp_path / "run"), ds, CFG, queue_config=QCFG, checkpoint={},
                         fsync=False)
    assert col.resume_info.path == "fresh"
    assert any("has no dataset cursor" in w for w in _warnings(caplog))
