"""The restore path: a trainer restored from a checkpoint pushes its restored weights to
the engines as a new version before it trains, and the batches after the checkpoint count
as untrained again (they are delivered and trained again)."""

from __future__ import annotations

import logging

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.delivery.batches import delivered
from strawq.storage import MemoryStorage
from strawq.tasks.queue import RunQueue
from tests.collector.test_ordering import N, _group, dataset  # noqa: F401 - fixture


@pytest.mark.timeout(60)
def test_restore_pushes_the_restored_weights_as_a_new_version(dataset, caplog):  # noqa: F811
    q = RunQueue.create(MemoryStorage(), QueueConfig(release_batch=N, fsync=False))
    col = Collector(q, dataset, CollectorConfig(batch_groups=2, max_running=N, max_ready=N,
                                                max_prefetch_batches=2, max_staleness=None,
                                                poll_interval_s=0, gc_interval_s=0))
    col.start(wait=False)
    col.step()
    leases = {x.task_id: x for x in q.claim("p", N)}
    for i in range(4):
        q.complete(leases[f"i{i:012d}"], _group(leases[f"i{i:012d}"], 0))
    col.step()
    reader = BatchReader(q, poll_interval_s=0.0)
    bracket = WeightUpdateBracket(q)
    b1 = reader.next_batch(timeout=1)
    reader.ack(b1)
    bracket.weight_update(lambda v: None)  # version 1
    ckpt = reader.state_dict()  # covers batch 1, weights of version 1
    reader.commit(ckpt)
    b2 = reader.next_batch(timeout=1)  # trained on version 1, then the trainer dies
    reader.ack(b2)
    bracket.weight_update(lambda v: None)  # version 2: weights the restored trainer lacks
    assert delivered(q.storage) == {b1.seq: 0, b2.seq: 1}
    assert col.step().progress.consumed >= {b2.seq}

    restored = BatchReader(q, poll_interval_s=0.0)
    restored.load_state_dict(ckpt)
    assert b2.seq not in delivered(q.storage)  # trained again: ahead again
    pushed: list[int] = []
    with caplog.at_level(logging.WARNING, logger="strawq.collector.trainer.bracket"):
        rep = WeightUpdateBracket(q).restore(pushed.append, ckpt)
    assert pushed == [3] and rep.version == 3 and q.current_version() == 3
    assert any("rollouts of versions 2..2" in r.getMessage() for r in caplog.records)
    step = col.step()
    assert b2.seq not in step.progress.consumed and step.progress.waiting >= 1
    again = restored.next_batch(timeout=1)
    assert again.seq == b2.seq and again.version == 3
