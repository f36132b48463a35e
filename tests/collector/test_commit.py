"""Trained means checkpointed: a trainer killed at any point between train, ack and save,
restored from its newest checkpoint, trains every group exactly once in its model's lineage.

The trainer's one order: train on the batch, ``ack(batch)``, and every N steps
``state = reader.state_dict()``, save, ``reader.commit(state)``. The collector garbage-
collects between every two steps (the worst case for a lost batch). A kill throws away
the model and the reader; the restart loads the newest saved checkpoint (model + reader
state) and goes on. At the end the model's lineage must hold every group once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BatchTimeout
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.delivery.commits import committed_seq
from strawq.storage import MemoryStorage
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import SimProducer, write_dataset

ROWS = 24
CFG = CollectorConfig(batch_groups=2, max_running=8, max_ready=8, max_prefetch_batches=2,
                      poll_interval_s=0, gc_interval_s=0)
POINTS = ("before_train", "after_train", "after_ack", "after_state_dict", "after_save",
          "after_commit")


class Killed(Exception):
    pass


@dataclass
class Trainer:
    """The model is the list of group ids it trained, in order; checkpoints copy it."""

    q: RunQueue
    interval: int
    explicit_commit: bool = True
    model: list[str] = field(default_factory=list)
    steps: int = 0
    saved: tuple[list[str], dict[str, Any], int] | None = None
    reader: BatchReader | None = None

    def restart(self) -> None:
        self.reader = BatchReader(self.q, sleep=lambda _dt: None)
        self.model, self.steps = [], 0
        if self.saved is not None:
            model, state, steps = self.saved
            self.model, self.steps = list(model), steps
            self.reader.load_state_dict(state)

    def step(self, batch: Batch, kill: tuple[int, str] | None) -> None:
        assert self.reader is not None
        step = self.steps + 1

        def point(name: str) -> None:
            if kill == (step, name):
                raise Killed(name)

        point("before_train")
        self.model += [g.id for g in batch.groups]
        self.steps = step
        point("after_train")
        self.reader.ack(batch)
        point("after_ack")
        if step % self.interval:
            return
        state = self.reader.state_dict()
        point("after_state_dict")
        self.saved = (list(self.model), state, step)
        point("after_save")
        if self.explicit_commit:
            self.reader.commit(state)
        point("after_commit")


def run(tmp_path: Any, interval: int, kills: list[tuple[int, str]],
        explicit_commit: bool = True) -> list[str]:
    storage = MemoryStorage()
    q = RunQueue.create(storage, QueueConfig(group_size=4, release_batch=8,
                                             lease_timeout_s=2.0, heartbeat_interval_s=0.2))
    col = Collector(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), ROWS)), CFG)
    col.start(wait=False)
    producer = SimProducer(q, "p", slots=8)
    trainer = Trainer(q, interval, explicit_commit)
    trainer.restart()
    pending = list(kills)
    for _ in range(3000):
        assert trainer.reader is not None
        try:
            batch = trainer.reader.next_batch(timeout=0)
        except BatchTimeout:
            rep = col.step()  # GC runs here every pass
            producer.step()
            if rep.drained:
                return trainer.model
            continue
        try:
            trainer.step(batch, pending[0] if pending else None)
        except Killed:
            pending.pop(0)
            trainer.restart()
        col.step()  # GC right after every step: an early collection would lose a batch
    pytest.fail("the run did not drain")


def check(model: list[str]) -> None:
    assert len(model) == len(set(model)), f"trained twice: {sorted(model)}"
    assert set(model) == {f"i{i:012d}" for i in range(ROWS)}, \
        f"lost: {sorted({f'i{i:012d}' for i in range(ROWS)} - set(model))}"


@pytest.mark.parametrize("interval", [1, 5, 10])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.timeout(120)
def test_kill_at_every_point_between_train_ack_and_save(tmp_path: Any, interval: int,
                                                        point: str) -> None:
    for at in (interval, interval + 1, 2 * interval + 1):
        check(run(tmp_path, interval, [(at, point)]))


@pytest.mark.timeout(120)
def test_repeated_kills_and_auto_commit_on_next_state_dict(tmp_path: Any) -> None:
    """No explicit commit: the next state_dict commits the previous checkpoint."""
    kills = [(3, "after_ack"), (6, "after_save"), (4, "after_train"), (7, "after_state_dict")]
    check(run(tmp_path, 5, kills, explicit_commit=False))
    check(run(tmp_path, 1, kills, explicit_commit=False))


@pytest.mark.timeout(60)
def test_gc_never_deletes_past_the_committed_position(tmp_path: Any) -> None:
    storage = MemoryStorage()
    q = RunQueue.create(storage, QueueConfig(group_size=4, release_batch=8))
    col = Collector(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), ROWS)), CFG)
    col.start(wait=False)
    producer = SimProducer(q, "p", slots=8)
    reader = BatchReader(q, sleep=lambda _dt: None)
    got: list[Batch] = []
    while len(got) < 4:
        try:
            got.append(reader.next_batch(timeout=0))
            reader.ack(got[-1])
        except BatchTimeout:
            col.step()
            producer.step()
    col.step()
    assert committed_seq(storage) == 0
    assert [s for s in col.batches.batch_seqs()[0] if s <= 4] == [1, 2, 3, 4]  # all kept
    reader.commit(reader.state_dict())
    col.step()
    assert committed_seq(storage) == 4
    assert not [s for s in col.batches.batch_seqs()[0] if s <= 4]
