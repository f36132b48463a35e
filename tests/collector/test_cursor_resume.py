"""Cursor resume (the queue state is lost; the run resumes from the checkpoint's dataset
cursor): the prompts in flight at the checkpoint are released again, so every prompt is
trained exactly once relative to the restored weights, and the log says what happened."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.delivery.checkpoint import in_flight
from tests.collector.helpers import SimProducer, drive, train_until_drained, write_dataset

N = 40
CFG = CollectorConfig(batch_groups=4, max_running=8, max_ready=8, max_prefetch_batches=2,
                      max_staleness=None, poll_interval_s=0, gc_interval_s=0,
                      takeover_timeout_s=0.05)
QCFG = QueueConfig(fsync=False, lease_timeout_s=2.0, heartbeat_interval_s=0.2,
                   release_batch=4)


def _indexes(batch) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(s["index"]) for s in batch.summaries]


@pytest.mark.timeout(120)
def test_cursor_resume_releases_what_was_in_flight(tmp_path, caplog):
    run = str(tmp_path / "run")
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), N))
    col = Collector.open(run, ds, CFG, queue_config=QCFG, fsync=False)
    prod = SimProducer(col.queue, "p0", seed=1, chunk=2, max_new=(4, 12))
    reader = BatchReader(col.queue)
    for _ in range(100):
        drive(col, [prod], 1)
        if col.batches.batch_seqs()[0]:
            break
    first = reader.next_batch(timeout=5)
    trained = _indexes(first)
    reader.ack(first)
    drive(col, [prod], 6)  # more work in flight: pending, leased, ready, maybe a batch
    state = reader.state_dict()
    ckpt = json.loads(json.dumps(state))  # what a checkpoint file holds
    flying = ckpt["feeder"]["in_flight"]
    assert flying, "nothing in flight at the checkpoint: the test would prove nothing"
    assert not set(flying) & set(trained)
    assert set(flying) | set(trained) == set(range(ckpt["feeder"]["next_index"]))
    col.close()
    shutil.rmtree(run)  # the queue state is lost

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        col2 = Collector.open(run, ds, CFG, queue_config=QCFG, checkpoint=ckpt, fsync=False)
    assert col2.resume_info is not None and col2.resume_info.path == "cursor"
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"the {len(flying)} prompts in flight at the checkpoint are released again"
               in m for m in msgs), msgs
    assert any(f"released {len(flying)} prompts again" in m for m in msgs), msgs
    reader2 = BatchReader(col2.queue)
    reader2.load_state_dict(ckpt)
    prod2 = SimProducer(col2.queue, "p1", seed=5, chunk=3)
    col2.step()
    assert train_until_drained(col2, prod2, reader2, lambda b: trained.extend(_indexes(b)))
    assert sorted(trained) == list(range(N)), "a prompt was skipped or trained twice"


def test_in_flight_counts_batches_after_the_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 12))
    col = Collector.open(run, ds, CFG, queue_config=QCFG, fsync=False)
    prod = SimProducer(col.queue, "p0", seed=2, chunk=20, max_new=(1, 3))
    for _ in range(50):
        drive(col, [prod], 1)
        if len(col.batches.batch_seqs()[0]) >= 2:
            break
    seqs, _ = col.batches.batch_seqs()
    assert len(seqs) >= 2
    one = {n.order for n in col.batches.read_manifest(seqs[0]).groups}
    # nothing acked: every released prompt is in flight; batch 1 trained: its groups are not
    assert one <= in_flight(col.storage)
    assert not one & in_flight(col.storage, trained_through=seqs[0])
