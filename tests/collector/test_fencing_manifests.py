"""The takeover window, closed: a stalled collector's manifest after a takeover is refused.

The old collector passes its fence check, takes its ready list, stalls past the takeover
timeout; its successor takes over. When the old one wakes it publishes one manifest. Readers
must refuse it (its epoch was superseded before its number), and the live collector puts its
groups back, so every group is trained exactly once.
"""

from __future__ import annotations

from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BatchTimeout
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.testing import audit_run
from tests.collector.helpers import FakeClock, SimProducer, make_run, write_dataset

CFG = CollectorConfig(batch_groups=2, max_running=8, max_ready=8, takeover_timeout_s=5.0,
                      poll_interval_s=0, gc_interval_s=0)
ROWS = 12


@pytest.fixture
def run(tmp_path: Any) -> tuple[Any, Dataset]:
    q = make_run(str(tmp_path / "run"))
    return q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), ROWS))


def _stall_after_check(first: Collector) -> tuple[list[Any], list[Any]]:
    """What ``first`` holds when it stalls: the groups and summaries of its next batch."""
    first.fence.check()
    names = first.batches.scan_ready()[:2]
    assert len(names) == 2
    return first.former.summaries(names)


def _stalled_and_successor(q: Any, ds: Dataset) -> tuple[Collector, SimProducer, list[Any],
                                                         list[Any], Collector]:
    """The old collector, stalled holding its next batch (names, summaries), the producer,
    and its successor, not started yet."""
    # the old collector never batches on its own here: only its one late manifest counts
    first = Collector(q, ds, CollectorConfig(batch_groups=100, max_running=8, max_ready=100,
                                             poll_interval_s=0))
    first.start(wait=False)
    producer = SimProducer(q, "p", slots=8)
    for _ in range(6):
        first.step()
        producer.step()
    while len(first.batches.scan_ready()) < 2:
        producer.step()
    names, summaries = _stall_after_check(first)
    clock = FakeClock()  # the old one is silent while the newcomer watches
    second = Collector(q, ds, CFG, clock=clock, sleep=clock.sleep)
    return first, producer, names, summaries, second


def _drain(col: Collector, producer: SimProducer, reader: BatchReader) -> list[str]:
    trained: list[str] = []
    for _ in range(400):
        rep = col.step()
        producer.step()
        try:
            batch = reader.next_batch(timeout=0)
        except BatchTimeout:
            if rep.drained:
                return trained
            continue
        trained += [g.id for g in batch.groups]
        reader.ack(batch)
    pytest.fail("the run did not drain")


@pytest.mark.parametrize("successor_batches_first", [True, False])
@pytest.mark.timeout(60)
def test_stalled_collectors_late_manifest_is_refused(run: Any,
                                                     successor_batches_first: bool) -> None:
    q, ds = run
    first, producer, names, summaries, second = _stalled_and_successor(q, ds)
    assert second.start() == 2
    if successor_batches_first:
        second.step()  # batches the groups the old one still holds
        assert {n.id for n in names} <= {n.id for n in second.batches.read_manifest(1).groups}
    # the old one wakes up and publishes at the next free number, stamped with its epoch
    seq = first.batches.next_seq()
    first.batches.publish_batch(seq, names, summaries,
                                {"epoch": first.fence.epoch, "owner": "collector"})
    reader = BatchReader(q, sleep=lambda _dt: None)
    # a prefetching trainer reads every published batch before it acks any
    early = []
    while True:
        try:
            early.append(reader.next_batch(timeout=0))
        except BatchTimeout:
            break
    trained = [g.id for batch in early for g in batch.groups]
    for batch in early:
        reader.ack(batch)
    trained += _drain(second, producer, reader)
    assert seq in reader.positions.refused, "the superseded manifest was delivered"
    assert len(trained) == len(set(trained)), f"trained twice: {sorted(trained)}"
    audit = audit_run(q.storage)
    done = set(trained) | audit.ids("dropped")
    assert done == {f"i{i:012d}" for i in range(ROWS)}, "a group was lost"
    assert not q.storage.exists(f"batches/{seq:012d}"), "the refused manifest was not swept"


@pytest.mark.timeout(60)
def test_a_late_manifest_the_successors_recovery_read_is_batched_again(run: Any) -> None:
    """The stalled collector publishes just after its successor marked its epoch's start and
    before the successor's recovery read the manifests: recovery takes the manifest's groups
    for batched (a batch leaves them in ``ready/``), and the refusal must give them back to
    its scans, or they are never trained."""
    q, ds = run
    first, producer, names, summaries, second = _stalled_and_successor(q, ds)
    recover = second.batches.recover
    published: list[int] = []

    def late_then_recover() -> list[Any]:
        seq = first.batches.next_seq()
        first.batches.publish_batch(seq, names, summaries,
                                    {"epoch": first.fence.epoch, "owner": "collector"})
        published.append(seq)
        return recover()

    second.batches.recover = late_then_recover  # type: ignore[method-assign]
    assert second.start() == 2
    assert published, "the late manifest was not published inside the successor's start"
    reader = BatchReader(q, sleep=lambda _dt: None)
    trained = _drain(second, producer, reader)
    assert published[0] in reader.positions.refused, "the superseded manifest was delivered"
    assert len(trained) == len(set(trained)), f"trained twice: {sorted(trained)}"
    audit = audit_run(q.storage)
    assert set(trained) | audit.ids("dropped") == {f"i{i:012d}" for i in range(ROWS)}, \
        "a group was lost"
