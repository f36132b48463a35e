"""The collector's counters and its metrics line, one per ``metrics_interval_s``.

``PassMetrics.count(rep)`` adds a pass to this incarnation's counters (released, batches,
expired leases, groups over η per ``eta_mode`` action); ``emit(rep, now)`` writes the line:
queue depths, admission, throughput, the counters, the drops per reason over the whole run
(``strawq.delivery.retention.drop_totals``), engines out of rotation, and every hook's values
(``CollectorHooks.metrics``: the operator's view, a mixture's sources).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from strawq.collector.config import CollectorConfig
from strawq.collector.hooks import CollectorHooks
from strawq.collector.ordering import StalenessOrder
from strawq.collector.report import StepReport
from strawq.collector.trainer.metrics import MetricsSink, dropped_metric
from strawq.data.feeder import Feeder
from strawq.delivery.retention import drop_totals
from strawq.storage import Storage
from strawq.weights.engine_weights import EngineWeights


class PassMetrics:
    """Counts the collector's passes and emits its metrics lines."""

    def __init__(self, config: CollectorConfig, storage: Storage, sink: MetricsSink,
                 order: StalenessOrder, hooks: CollectorHooks,
                 epoch: Callable[[], int], feeder: Callable[[], Feeder | None]) -> None:
        self.config = config
        self.storage = storage
        self.sink = sink
        self.order = order
        self.hooks = hooks
        self._epoch = epoch
        self._feeder = feeder
        self.steps = 0
        #: counters of this incarnation (the metrics sink continues them across restarts)
        self.totals = {"released": 0, "batches": 0, "expired": 0}
        #: groups over η this incarnation, per policy action (``eta_mode``)
        self.stale_totals = {"trained": 0, "regenerated": 0, "dropped": 0}
        self._last = float("-inf")
        self._ready_seen = 0

    def count(self, rep: StepReport) -> None:
        """Add one pass's work to the counters."""
        self.steps += 1
        self.stale_totals["trained"] += len(rep.stale_trained)
        self.stale_totals["regenerated"] += len(rep.requeued_stale)
        self.stale_totals["dropped"] += len(rep.dropped_stale)
        self.totals["released"] += rep.released
        self.totals["batches"] += len(rep.published)
        self.totals["expired"] += len(rep.scan.expired) if rep.scan else 0

    def dropped_by_reason(self) -> dict[str, int]:
        """Per reason over the whole run: the drop audit's counts plus ``dropped/``."""
        return drop_totals(self.storage)

    def emit(self, rep: StepReport, now: float) -> None:
        """Write a metrics line if ``metrics_interval_s`` has passed since the last one."""
        if now - self._last < self.config.metrics_interval_s:
            return
        elapsed = now - self._last if self._last > float("-inf") else 0.0
        new_ready = self.order.observed_total - self._ready_seen
        self._ready_seen = self.order.observed_total
        self._last = now
        d = rep.depths
        feeder = self._feeder()
        values: dict[str, Any] = {
            "collector/step": self.steps, "collector/epoch": self._epoch(),
            "queue/version": rep.version, "queue/pending": d.pending,
            "queue/partial": d.partial, "queue/leased": d.leased, "queue/ready": d.ready,
            "queue/batched": d.batched, "queue/prefetched_batches": rep.prefetched,
            "collector/released": rep.released,
            "collector/admission_capacity": rep.admission.capacity if rep.admission else 0,
            "collector/groups_per_s": new_ready / elapsed if elapsed > 0 else 0.0,
            "collector/expired_leases": len(rep.scan.expired) if rep.scan else 0,
            "collector/released_total": self.totals["released"],
            "collector/batches_total": self.totals["batches"],
            "collector/expired_leases_total": self.totals["expired"],
            # passes over the dataset (queue.num_epochs) and the rows the history skipped
            "dataset/pass": feeder.cursor.epoch if feeder else 0,
            "collector/skipped_zero_variance_total": feeder.skipped_total if feeder else 0,
            "collector/stale_trained_total": self.stale_totals["trained"],
            "collector/stale_regenerated_total": self.stale_totals["regenerated"],
            "collector/stale_dropped_total": self.stale_totals["dropped"],
            # engines noted on weights other than the run's (engines/): out of rotation
            "engines/needing_weights": len(EngineWeights(self.storage).needing()),
        }
        for reason, count in self.dropped_by_reason().items():
            values[dropped_metric(reason)] = count
        values.update(self.hooks.metrics())  # a mixture's dataset/<source>/...
        self.sink.emit(values)
