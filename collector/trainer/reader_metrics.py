"""The reader's metrics line, one per delivered batch (rank 0, when a sink is given).

The batch's size (groups, samples, tokens, its ``stats``), the step count, how long the
trainer waited for it and which share of the step that was (``trainer/wait_ratio``: the
time since the previous delivery), and the queue's depths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from strawq.collector.trainer.loading import Batch
from strawq.collector.trainer.metrics import MetricsSink
from strawq.delivery.batches import BatchStore, queue_depths
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue


class ReaderMetrics:
    """Counts deliveries and writes their metrics lines to the reader's sink."""

    def __init__(self, storage: Storage, clock: Callable[[], float]) -> None:
        self.storage = storage
        self.clock = clock
        self.steps = 0
        self._last_return: float | None = None
        self._batches: BatchStore | None = None  # reads each manifest once for the depths

    def delivered(self, batch: Batch, wait_s: float, sink: MetricsSink | None) -> None:
        """``batch`` is returned to the trainer after ``wait_s`` seconds of waiting; its line
        goes to ``sink`` (None: counted only)."""
        now = self.clock()
        step_s = now - self._last_return if self._last_return is not None else None
        self._last_return = now
        self.steps += 1
        if sink is None:
            return
        values: dict[str, Any] = {"trainer/step": self.steps, "batch/seq": batch.seq,
                                  "batch/groups": len(batch.groups),
                                  "batch/samples": batch.num_samples,
                                  "batch/tokens": batch.num_tokens,
                                  "trainer/wait_s": wait_s, "queue/version": batch.version,
                                  **batch.stats}
        if step_s is not None and step_s > 0:
            values["trainer/wait_ratio"] = min(wait_s / step_s, 1.0)
        if self._batches is None:
            self._batches = BatchStore(RunQueue(self.storage))
        d = queue_depths(self.storage, store=self._batches)
        for state in ("pending", "partial", "leased", "ready", "batched"):
            values[f"queue/{state}"] = getattr(d, state)
        sink.emit(values)
