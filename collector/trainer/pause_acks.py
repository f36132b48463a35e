"""Which producers a weight-update bracket waits for, and the wait for their acks.

Liveness is judged as the grantor judges leases (docs/design.md, invariant 3): heartbeat
counters observed on this process's monotonic clock through a ``LeaseMonitor``, never file
times. A producer silent for ``liveness_s`` (at most the lease timeout), or whose heartbeat
file names a process on this host that is gone, is not waited for: its replies are
version-stamped and its results lease-fenced. An idle producer holds no lease and is not
waited for either (it beats as it leaves its idle mark, before it reads ``control/``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from strawq.errors import BracketTimeout, StrawqError
from strawq.liveness import known_dead, parse_identity
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.weights.control import ACKS, Control

log = logging.getLogger(__name__)


class ProducerLiveness:
    """Producers' liveness for a bracket, on this process's clock."""

    def __init__(self, queue: RunQueue, *, monitor: LeaseMonitor | None,
                 lease_timeout_s: float | None, liveness_timeout_s: float | None,
                 clock: Callable[[], float]) -> None:
        self.queue = queue
        self.clock = clock
        self.lease_timeout_s = lease_timeout_s or queue.config.lease_timeout_s
        #: heartbeat silence after which a producer is not waited for (at most the lease
        #: timeout; the run's ``liveness_timeout_s`` by default)
        self.liveness_s = min(liveness_timeout_s or queue.config.liveness_s,
                              self.lease_timeout_s)
        #: producer -> (counter, identity its heartbeat file names) (``gone``)
        self._identities: dict[str, tuple[int, dict[str, Any] | None]] = {}
        # Pass the collector's monitor when it runs in this process: its observations are
        # then the grantor's own. Otherwise a private one: call observe() every step so it
        # knows which producers went silent long ago.
        self.monitor = monitor or LeaseMonitor(queue, lease_timeout_s=self.lease_timeout_s,
                                               clock=clock)

    def observe(self) -> dict[str, float]:
        """Read heartbeat counters now; returns producer -> seconds since its counter moved."""
        now = self.clock()
        self.monitor.observe_heartbeats(now)
        return self.monitor.silence(now)

    def live_producers(self) -> set[str]:
        """Producers to wait for: beating within the liveness timeout, not a gone process
        of this host, and not idle."""
        silence = self.observe()
        return {p for p, s in silence.items()
                if s < self.liveness_s and p not in self.monitor.idle and not self.gone(p)}

    def gone(self, producer: str) -> bool:
        """Whether ``producer``'s heartbeat file, at the counter last seen, names a process
        on this host that no longer exists (never True for another host's producer)."""
        counter = self.monitor.counter(producer)
        key = self.monitor.key(producer)
        if counter is None or key is None:
            return False
        cached = self._identities.get(producer)
        if cached is None or cached[0] != counter:
            try:
                body = self.queue.storage.read(key)
            except StrawqError:
                return False  # moved on (it beats) or unreadable: the silence decides
            cached = (counter, parse_identity(body))
            self._identities[producer] = cached
        return known_dead(cached[1])

    def wait_for_acks(self, control: Control, version: int, timeout: float, *,
                      sleep: Callable[[float], None], poll_interval_s: float
                      ) -> tuple[frozenset[str], dict[str, float], float]:
        """Wait until every live producer acked the pause for ``version``: the acks, the
        producers judged dead meanwhile (seconds silent) and the seconds waited;
        ``BracketTimeout`` (the pause stays open) after ``timeout``."""
        start = self.clock()
        dead: dict[str, float] = {}
        while True:
            silence = self.observe()
            acks = control.state().acks
            missing = {}
            for p, s in silence.items():
                if p in acks:
                    continue
                if s >= self.liveness_s or self.gone(p):
                    if p not in dead:
                        why = (f"silent for {s:.1f}s" if s >= self.liveness_s else
                               "its process on this host is gone")
                        log.warning("producer %s %s: judged dead, not waited for (its leases "
                                    "expire after the lease timeout)", p, why)
                    dead[p] = s
                else:
                    missing[p] = s
            waited = self.clock() - start
            if not missing:
                return acks, dead, waited
            if waited >= timeout:
                raise BracketTimeout(
                    f"weight update to version {version}: producers {sorted(missing)} are "
                    f"alive (heartbeats moved {', '.join(f'{s:.1f}s' for s in missing.values())}"
                    f" ago) but did not acknowledge the pause within {timeout:.1f}s; expected "
                    f"control/{ACKS.name(version, '<producer>')}. The pause stays open: retry "
                    "begin_weight_update(), or abort_weight_update() to let them carry on",
                    missing)
            sleep(poll_interval_s)

    def stray_leases(self, acks: frozenset[str], *, control: Control | None = None,
                     version: int = 0) -> list[str]:
        """Leases still held by producers that acked the pause (a producer bug: an ack means
        "holds none", unless it says it holds them: ``held``, a producer holding its groups
        through the pause, ``timing.hold_through_pause``, read from ``control``'s ack of
        ``version``); logged as an error, left to the grantor."""
        by: dict[str, list[str]] = {}
        for t in names_in(self.queue.storage, TaskState.LEASED):
            if t.producer in acks:
                by.setdefault(t.producer, []).append(str(t))
        out = [t for p, ts in by.items()
               if control is None or control.held(version, p) < len(ts) for t in ts]
        if out:
            log.error("producers acked the pause but still hold leases %s; they will be "
                      "expired by the grantor if their holders stop beating", out)
        return out
