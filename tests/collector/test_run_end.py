"""A run that ends: the collector waits for the trainer's last commit, publishes the
``finished`` record, the trainer's reader answers ``RunFinished`` at once, producers stop.

In process, on the collector's injected clock: nothing here waits for a timeout (a test that
finishes within its pytest timeout did not wait the reader's 600 s)."""

from __future__ import annotations

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.delivery.commits import committed_seq
from strawq.errors import RunFinished
from strawq.tasks.finished import finished
from strawq.tasks.states import depths
from tests.collector.helpers import (
    FakeClock,
    SimProducer,
    make_run,
    train_until_drained,
    write_dataset,
)

CFG = CollectorConfig(batch_groups=2, max_running=8, max_ready=8, poll_interval_s=0.0,
                      gc_interval_s=0.0)


def _drained_run(tmp_path, *, checkpointed: bool, commit_last: bool):
    """A run driven until every batch is acked; a checkpointing trainer commits after each
    batch but the last (unless ``commit_last``)."""
    q = make_run(str(tmp_path / "run"))
    clock = FakeClock()
    col = Collector(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 6)), CFG,
                    clock=clock, sleep=clock.sleep)
    col.start(wait=False)
    reader = BatchReader(q, checkpointed=checkpointed)
    seen: list[int] = []

    def on_batch(b) -> bool:
        seen.append(b.seq)
        if checkpointed:
            if seen[:-1]:
                reader.commit(seen[-2])
        return False

    assert train_until_drained(col, SimProducer(q, "p", seed=1), reader, on_batch)
    if commit_last and checkpointed:
        reader.commit(seen[-1])
    return q, col, clock, reader, seen


@pytest.mark.timeout(60)
def test_the_reader_answers_run_finished_at_once_once_the_run_has_drained(tmp_path) -> None:
    q, col, _clock, reader, _seen = _drained_run(tmp_path, checkpointed=False,
                                                 commit_last=False)
    col.run(until_drained=True)
    assert finished(q.storage) is not None
    with pytest.raises(RunFinished, match="has finished"):
        reader.next_batch(timeout=600)  # before: a 600 s wait, then "check the collector"


@pytest.mark.timeout(60)
def test_the_collector_waits_for_the_trainers_last_commit_then_collects(tmp_path) -> None:
    q, col, clock, reader, seen = _drained_run(tmp_path, checkpointed=True, commit_last=False)
    assert committed_seq(q.storage) == seen[-2]
    # the trainer's last commit comes while the collector waits (on its clock)
    clock.hook = lambda: reader.commit(seen[-1]) if finished(q.storage) is not None else None
    rep = col.run(until_drained=True)
    assert committed_seq(q.storage) == seen[-1]
    assert rep.depths.batched == 0 and depths(q.storage).batched == 0
    assert q.storage.list("batches") == []


@pytest.mark.timeout(60)
def test_the_wait_for_the_last_commit_is_bounded(tmp_path, caplog) -> None:
    q, col, _clock, _reader, seen = _drained_run(tmp_path, checkpointed=True,
                                                 commit_last=False)
    rep = col.run(until_drained=True)  # nobody commits: finish_wait_s on the fake clock
    assert "did not commit" in caplog.text
    assert rep.depths.batched > 0  # left for a later commit and 'strawq gc'
    assert finished(q.storage) == {**finished(q.storage), "last_seq": seen[-1]}


def test_a_collector_that_starts_on_a_finished_run_clears_the_record(tmp_path) -> None:
    q, col, _clock, _reader, _seen = _drained_run(tmp_path, checkpointed=False,
                                                  commit_last=False)
    col.run(until_drained=True)
    col.close()
    assert finished(q.storage) is not None
    again = Collector(q, col.dataset, CFG)
    again.start(wait=False)
    assert finished(q.storage) is None  # published again when this incarnation drains
    again.close()
