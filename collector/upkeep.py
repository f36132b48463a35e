"""The collector's upkeep of the run's disk: GC and sweeps on a schedule, the low-disk warning,
and passes that fail on a full disk.

``GcSchedule.due(now)`` collects acked batches every ``gc_interval_s`` (``BatchStore.gc``)
and, at most every ``SWEEP_INTERVAL_S``, sweeps ``data/`` (``strawq.delivery.retention``), dead
writers' temporary files, and warns while the disk is low (``disk_warn_share``).
``FullDisk`` holds the one-line message while passes fail on ENOSPC or EDQUOT
(``Collector.run`` retries): said once, then every ``FULL_REMIND_S``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from strawq.collector.config import CollectorConfig
from strawq.delivery.batches import BatchStore, GcReport
from strawq.errors import StorageFull
from strawq.storage import Storage
from strawq.views.status import disk_space, full_message, low_message

log = logging.getLogger(__name__)

#: Seconds between sweeps of ``data/`` (``strawq.delivery.retention``) on the collector's clock.
SWEEP_INTERVAL_S = 30.0
#: ``dropped/`` entries that trigger a compaction into the drop audit during a run.
COMPACT_DROPS_AT = 1000
#: The longest wait between passes while the disk is full (``Collector.run``).
FULL_RETRY_MAX_S = 2.0
#: Seconds between reminders in the log while the disk stays full.
FULL_REMIND_S = 60.0


class GcSchedule:
    """When a pass collects acked batches and sweeps the run (the collector's clock)."""

    def __init__(self, config: CollectorConfig, batches: BatchStore) -> None:
        self.config = config
        self.batches = batches
        self.storage = batches.storage
        self._last_gc = float("-inf")
        self._last_sweep = float("-inf")

    def due(self, now: float) -> GcReport | None:
        """Collect (and sweep) if it is time; the report, or None when it was not."""
        if now - self._last_gc < self.config.gc_interval_s:
            return None
        sweep = now - self._last_sweep >= max(SWEEP_INTERVAL_S, self.config.gc_interval_s)
        report = self.batches.gc(sweep=sweep, compact_drops_at=COMPACT_DROPS_AT)
        self._last_gc = now
        if sweep:
            self._last_sweep = now
            report.tmp += self.storage.clean_dead_tmp()  # writers found dead, unnamed
            self.warn_low_disk()
        return report

    def final(self) -> GcReport:
        """The last collection of a finished run: every acked batch, with a sweep."""
        return self.batches.gc(sweep=True, compact_drops_at=COMPACT_DROPS_AT)

    def warn_low_disk(self) -> None:
        """Warn while the run's disk is low (``disk_warn_share``), before writes fail."""
        share = self.config.disk_warn_share
        disk = disk_space(self.storage, low_share=share) if share > 0 else {}
        if disk.get("low") and not disk.get("full"):
            log.warning("%s", low_message(disk["path"], disk))


class FullDisk:
    """Passes that fail on a full disk: the message that says so, and when to repeat it."""

    def __init__(self, storage: Storage, clock: Callable[[], float]) -> None:
        self.storage = storage
        self.clock = clock
        #: while passes fail on a full disk (ENOSPC, EDQUOT): the one-line message that
        #: says so; None otherwise
        self.message: str | None = None
        self._since = 0.0
        self._logged = 0.0

    def note(self, exc: StorageFull) -> None:
        """A pass failed on a full disk: say so once, then every ``FULL_REMIND_S``. What the
        pass wrote before the failure is whole (every write is atomic) and the next pass
        picks up from the disk: a half-staged release is discarded by the next commit, a
        manifest that failed was never published."""
        now = self.clock()
        root = getattr(self.storage, "root", self.storage.describe())
        if self.message is None:
            self._since = now
            self._logged = -FULL_REMIND_S
        self.message = f"collector: {full_message(root)} ({exc.strerror})"
        if now - self._logged >= FULL_REMIND_S:
            log.error("%s; retrying every %.0f s at most", self.message, FULL_RETRY_MAX_S)
            self._logged = now

    def passed(self) -> None:
        """A pass succeeded: if the disk was full, say that space is back."""
        if self.message is not None:
            log.info("collector: space is back after %.0f s; the run goes on",
                     self.clock() - self._since)
            self.message = None
