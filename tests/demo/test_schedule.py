"""The schedules' collector settings and ack order (``strawq.demo.schedule``): logic, not
timings. The ack-order test runs the real queue, collector, bracket and reader with the
test suite's in-process producer (``tests.collector.helpers.SimProducer``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from strawq.collector.core import Collector
from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.data.dataset import Dataset
from strawq.delivery.commits import commit
from strawq.demo.schedule import (MODES, ScheduleConfig, ScheduleResult, collector_config,
                                  run_schedule)
from strawq.demo.trainer import SleepTrainer
from strawq.errors import ConfigError
from strawq.tasks.queue import RunQueue
from strawq.weights.fingerprint import Fingerprint, Fingerprints, fingerprint_of
from tests.collector.helpers import SimProducer, make_run, write_dataset


def test_collector_config_per_mode() -> None:
    base = dict(batch_groups=96, max_staleness=1, slots=48, micro_batches=8)
    c = collector_config(ScheduleConfig(mode="stream", **base))
    assert (c.batch_groups, c.batches_per_version, c.admission_batches) == (12, 8, None)
    # flow acks each micro-batch as trained; admission counts deliveries, not acks, so the
    # default window (eta + 1)·m keeps eta for it too
    c = collector_config(ScheduleConfig(mode="flow", **base))
    assert (c.batch_groups, c.batches_per_version, c.admission_batches) == (12, 8, None)
    assert c.max_prefetch_batches == 8 and c.eta_mode == "hard"  # the default: eta a hard bound
    c = collector_config(ScheduleConfig(mode="flow", admission_batches=10.5, **base))
    assert c.admission_batches == 10.5
    c = collector_config(ScheduleConfig(mode="async", **base))
    assert (c.batch_groups, c.batches_per_version, c.admission_batches) == (96, 1, None)
    for mode in ("sync", "partial"):  # a window would undo the barrier / the over-sampling
        c = collector_config(ScheduleConfig(mode=mode, admission_batches=3, **base))
        assert c.admission_batches is None, mode
    assert set(MODES) >= {"sync", "partial", "async", "stream", "flow"}


def test_flow_needs_micro_batches_that_divide_the_batch() -> None:
    with pytest.raises(ConfigError, match="micro_batches"):
        ScheduleConfig(mode="flow", batch_groups=96, micro_batches=7)


def test_micro_batches_bind_only_the_streaming_modes() -> None:
    # the lab hands every mode one micro-batch count; sync and async read one batch a step
    for mode in ("sync", "async"):
        assert ScheduleConfig(mode=mode, batch_groups=12, micro_batches=8).per_step == 1
    with pytest.raises(ConfigError, match="micro_batches"):
        ScheduleConfig(mode="stream", batch_groups=12, micro_batches=8)


@dataclass
class _AckRecorder(SleepTrainer):
    """Records, at each micro-batch, which batches were acked before it was trained."""

    reader: BatchReader | None = None
    seen: list[tuple[int, set[int]]] = field(default_factory=list)

    def train_step(self, batch: Batch) -> dict[str, float]:
        assert self.reader is not None
        _, acked = self.reader.batches.batch_seqs()
        self.seen.append((batch.seq, acked))
        return super().train_step(batch)

    def push_weights(self, version: int) -> None:
        pass  # no engines


def _schedule(tmp_path, mode: str, trainer_cls: type[_AckRecorder] = _AckRecorder
              ) -> tuple[ScheduleResult, _AckRecorder, RunQueue]:
    """Two steps of ``mode`` (two micro-batches each where it streams) on the real queue,
    collector, bracket and reader, with the in-process producer."""
    q = make_run(str(tmp_path / mode))
    ds = Dataset(write_dataset(str(tmp_path / f"{mode}.jsonl"), 200))
    sched = ScheduleConfig(mode=mode, batch_groups=4, steps=2, max_staleness=1, slots=4,
                           micro_batches=2, timeout_s=60)
    col = Collector(q, ds, collector_config(sched, poll_interval_s=0, gc_interval_s=0))
    col.start(wait=False)
    commit(q.storage, 0)  # a checkpointing trainer's retention: acked batches stay listed
    prod = SimProducer(q, "p0", slots=4, chunk=50)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            col.step()
            prod.step()
            stop.wait(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    reader = BatchReader(q, checkpointed=False, poll_interval_s=0.005)
    bracket = WeightUpdateBracket(q, lease_timeout_s=30, poll_interval_s=0.005)
    trainer = trainer_cls(0.0, [], reader=reader)
    try:
        res = run_schedule(sched, reader, bracket, trainer)
    finally:
        stop.set()
        thread.join(10)
    assert [r.version for r in res.records] == [1, 2]
    return res, trainer, q


def _run(tmp_path, mode: str) -> list[tuple[int, set[int]]]:
    return _schedule(tmp_path, mode)[1].seen


@pytest.mark.timeout(120)
def test_flow_acks_each_micro_batch_stream_acks_the_step(tmp_path) -> None:
    # two steps of two micro-batches each: (seq, acked before it was trained)
    flow = _run(tmp_path, "flow")
    assert len(flow) == 4
    assert flow[0][0] in flow[1][1]  # flow: the step's first micro-batch acked before its second
    assert flow[2][0] in flow[3][1]
    stream = _run(tmp_path, "stream")
    assert len(stream) == 4
    assert stream[0][0] not in stream[1][1]  # stream: acked with the step, after its update
    assert stream[0][0] in stream[2][1]  # ... so before the next step's first micro-batch


@dataclass
class _Fingerprinted(_AckRecorder):
    """A trainer whose pushed weights have a fingerprint (one per version pushed)."""

    pushed: list[int] = field(default_factory=list)

    def push_weights(self, version: int) -> None:
        self.pushed.append(version)  # no engines: none to attest

    def fingerprint(self) -> Fingerprint | None:
        return fingerprint_of({"w": [float(self.pushed[-1])]}, dtype="float32")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_pushed_version_publishes_the_trainers_fingerprint(tmp_path, mode) -> None:
    """The schedule publishes ``trainer.fingerprint()`` for every version it pushes: the
    bracket attests the engines against it (issue 39)."""
    _, trainer, q = _schedule(tmp_path, mode, _Fingerprinted)
    assert isinstance(trainer, _Fingerprinted) and trainer.pushed == [1, 2]
    book = Fingerprints(q.storage)
    for v in (1, 2):
        fp = book.get(v)
        assert fp is not None and fp == fingerprint_of({"w": [float(v)]}, dtype="float32")
