"""The collector's metrics for an operator: liveness, the open bracket, disk and quarantine.

A hook (``strawq.collector.hooks``: its ``metrics()`` joins every metrics line) over what the
collector already holds: the grantor's heartbeat silences (its own monotonic clock, the one
that expires leases: docs/design.md, invariant 3), the bracket's state in ``control/``, the
filesystem under the run and ``quarantine/``. Names (``strawq.views.prom`` turns them into series):

* ``collector/up`` (1), ``producers/known``, ``producers/live``;
* per producer ``producer/<id>/heartbeat_age_s``, ``producer/<id>/up`` (0 once silent for the
  lease timeout, idle ones included), ``producer/<id>/idle``;
* ``bracket/open`` (0/1), ``bracket/open_s`` (since this collector first saw it open, on its
  clock), ``bracket/unacked_producers`` (live producers it still waits for);
* ``disk/free_bytes``, ``disk/free_ratio``; ``queue/quarantined``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from strawq.collector.hooks import CollectorHooks
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.views.status import disk_space
from strawq.weights.control import read_state


class OpsMetrics(CollectorHooks):
    """Liveness, bracket, disk and quarantine values for the collector's metrics lines."""

    def __init__(self, queue: RunQueue, monitor: LeaseMonitor, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.monitor = monitor
        self.clock = clock
        self._opened: tuple[int, float] | None = None  # (pause version, first seen open at)

    def metrics(self) -> dict[str, Any]:
        cfg = self.queue.config
        st = self.queue.storage
        now = self.clock()
        out: dict[str, Any] = {"collector/up": 1}
        silence = self.monitor.silence(now)
        idle = self.monitor.idle
        live = 0
        for p, s in sorted(silence.items()):
            up = s < cfg.lease_timeout_s + (cfg.heartbeat_interval_s if p in idle else 0.0)
            live += int(p not in idle and s < cfg.liveness_s)
            out[f"producer/{p}/heartbeat_age_s"] = s
            out[f"producer/{p}/up"] = int(up)
            out[f"producer/{p}/idle"] = int(p in idle)
        out["producers/known"] = len(silence)
        out["producers/live"] = live
        bracket = read_state(st)
        waiting = 0
        if bracket.paused:
            if self._opened is None or self._opened[0] != bracket.pause_version:
                self._opened = (bracket.pause_version, now)
            waiting = sum(1 for p, s in silence.items() if p not in bracket.acks
                          and p not in idle and s < cfg.liveness_s)
        else:
            self._opened = None
        out["bracket/open"] = int(bracket.paused)
        out["bracket/open_s"] = now - self._opened[1] if self._opened else 0.0
        out["bracket/unacked_producers"] = waiting
        disk = disk_space(st)
        if disk:
            out["disk/free_bytes"] = disk["free_bytes"]
            if disk.get("free_ratio") is not None:
                out["disk/free_ratio"] = disk["free_ratio"]
        out["queue/quarantined"] = len(st.list("quarantine"))
        return out
