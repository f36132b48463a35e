"""Producer accounting: trajectory-slot utilisation and per-group counters.

Slot utilisation = busy trajectory-slot-seconds ÷ capacity-slot-seconds, where capacity =
group slots × G at each moment (``set_slots`` changes it) and *busy* counts trajectories
whose sample is still generating (claimed and unfinished). Both are integrated exactly
at every change, on an injected clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


class SlotMeter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.busy = 0
        self.capacity = 0
        self._t = clock()
        self._t0 = self._t
        self.busy_s = 0.0
        self.capacity_s = 0.0

    def _advance(self) -> None:
        now = self.clock()
        dt = now - self._t
        if dt > 0:
            self.busy_s += self.busy * dt
            self.capacity_s += self.capacity * dt
        self._t = now

    def set_capacity(self, n: int) -> None:
        self._advance()
        self.capacity = n

    def add(self, n: int) -> None:
        self._advance()
        self.busy += n

    def reset(self) -> None:
        """Start a new measurement window (busy/capacity kept)."""
        self._advance()
        self.busy_s = self.capacity_s = 0.0
        self._t0 = self._t

    def utilisation(self) -> float:
        self._advance()
        return self.busy_s / self.capacity_s if self.capacity_s > 0 else 0.0

    def window_s(self) -> float:
        self._advance()
        return self._t - self._t0


#: hop samples kept per hop and producer (the newest)
HOP_SAMPLES = 10_000


@dataclass
class ProducerStats:
    producer_id: str = ""
    node_id: str | None = None
    slots: int = 0
    group_size: int = 0
    busy_trajectories: int = 0
    groups_claimed: int = 0
    groups_completed: int = 0
    groups_dropped: int = 0
    groups_yielded: int = 0
    groups_failed: int = 0
    groups_released: int = 0
    leases_lost: int = 0
    samples_finished: int = 0
    tokens_generated: int = 0
    reward_errors: int = 0
    engine_faults: int = 0
    #: claim-time probes after an engine fault that reached no engine (claimed nothing)
    engine_probes_failed: int = 0
    unexpected_aborts: int = 0
    #: fresh groups whose prompt was prefilled once before their samples (``warm_prefix``)
    prefix_warmups: int = 0
    #: segments aborted at their deadline (``ClientConfig.generate_timeout_s``), tokens kept
    segment_deadlines: int = 0
    #: engines on weights other than the run's version (strawq.producers.engine_versions):
    #: replies discarded and their tokens, engines taken out / put back, out now, all out
    stale_replies: int = 0
    stale_tokens_discarded: int = 0
    engines_marked_stale: int = 0
    engines_restored: int = 0
    #: rolling updates (``strawq.producers.rolling``): engine loads this producer drove,
    #: their failures, the engine-milliseconds they held an engine out of rotation, the
    #: resumed prefix tokens (any mode), those the engine prefilled again (not in its prefix
    #: cache), and those resumed on an engine of another version
    rolling_loads: int = 0
    rolling_load_failures: int = 0
    rolling_pause_ms: int = 0
    resumed_tokens: int = 0
    resumed_tokens_prefilled: int = 0
    resumed_tokens_other_version: int = 0
    engines_stale: int = 0
    waiting_for_weights: bool = False
    #: replies on the run's version from an engine that failed attestation (or has no
    #: verdict yet): refused and re-issued, and their tokens (strawq.weights.fingerprint)
    attestation_refused_replies: int = 0
    attestation_refused_tokens: int = 0
    #: tool calls executed / returned from the record on a replay / failed tries
    tool_calls: int = 0
    tool_calls_replayed: int = 0
    tool_errors: int = 0
    #: turn checkpoints saved (``strawq.tasks.turns``); in-flight tool calls run again with their
    #: key after a resume / settled by their ``reconcile`` hook; calls left running at a
    #: pause (their result applied on resume)
    turn_checkpoints: int = 0
    turn_checkpoints_loaded: int = 0
    #: in-flight journal (``strawq.producers.journal_flush``): records written, groups
    #: yielded into it at a park, groups resumed from a journal prefix
    journal_records: int = 0
    groups_yielded_journal: int = 0
    journal_resumes: int = 0
    #: groups kept through a bracket's pause with their lease (``timing.hold_through_pause``)
    groups_held: int = 0
    tool_calls_rerun: int = 0
    tool_calls_reconciled: int = 0
    tool_calls_detached: int = 0
    brackets: int = 0
    #: claimed partial tasks past the η bound (``strawq.tasks.eta``): resumed anyway
    #: (``eta_mode="train"``) / prefix discarded, generated afresh (``regenerate``); those
    #: dropped (``drop``) are in ``drop_reasons["stale_eta"]``
    partials_over_eta: int = 0
    partials_regenerated: int = 0
    paused: bool = False
    #: no heartbeat succeeded past its deadline (claims nothing) / beats carry the idle mark
    heartbeat_failing: bool = False
    idle: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    slot_utilisation: float = 0.0
    cpu_s_per_group: float | None = None
    drop_reasons: dict[str, int] = field(default_factory=dict)
    #: hand-off latencies in seconds, the last ``HOP_SAMPLES`` of each (``StatsBook.hop``)
    hops: dict[str, list[float]] = field(default_factory=dict)

    @property
    def groups_done(self) -> int:
        """Groups that left this producer finished: ready or dropped by the filter."""
        return self.groups_completed + self.groups_dropped

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups_done"] = self.groups_done
        return d


class StatsBook:
    """A producer's ``ProducerStats`` behind one lock: its parts bump counters on the
    event loop, ``Producer.stats`` copies them from any thread."""

    def __init__(self, stats: ProducerStats) -> None:
        self.lock = threading.Lock()
        self._stats = stats

    def bump(self, counter: str, n: int = 1) -> None:
        with self.lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + n)

    def count_drop(self, reason: str) -> None:
        with self.lock:
            self._stats.groups_dropped += 1
            self._stats.drop_reasons[reason] = self._stats.drop_reasons.get(reason, 0) + 1

    def hop(self, name: str, seconds: float) -> None:
        """One sample of a hand-off latency (claim -> first request, final -> ready)."""
        with self.lock:
            xs = self._stats.hops.setdefault(name, [])
            xs.append(seconds)
            if len(xs) > HOP_SAMPLES:
                del xs[:len(xs) - HOP_SAMPLES]

    def get(self, counter: str) -> int:
        with self.lock:
            value = getattr(self._stats, counter)
        return int(value)

    def snapshot(self) -> ProducerStats:
        """A copy (the caller fills the gauges: busy, utilisation, wall and CPU time)."""
        with self.lock:
            s = ProducerStats(**{k: v for k, v in vars(self._stats).items()})
            s.drop_reasons = dict(self._stats.drop_reasons)
            s.hops = {k: list(v) for k, v in self._stats.hops.items()}
        return s
