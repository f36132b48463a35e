"""Hand-off latencies ("hops") of a live run, and the stretches in which nobody works.

A ``HopTracer`` watches the run directory with inotify (``strawq.storage.watch``) and times
every transition a task makes as it moves through the queue, from the moment its file
appears in the next state's directory:

=====================  ==================================================================
hop                    from → to
=====================  ==================================================================
``release_to_claim``   the release directory (or a returned/partial task) appears in
                       ``pending/`` → the task's lease appears in ``leased/``
``claim_to_generate``  claim → the producer sends the group's first generation request
                       (the producer's own clock; the engine starts on receipt)
``final_to_ready``     the group's last sample is final → its entry appears in ``ready/``
                       (rewards, filter, payload write + fsync, rename)
``ready_to_batch``     ``ready/`` entry → the manifest naming it appears in ``batches/``
                       (includes waiting for the batch's other groups and for the ack
                       of the batch before: not all of it is dead time)
``batch_due``          the moment a batch could be formed (its last group ready and the
                       previous batch acked) → its manifest appears: the collector's lag
``batch_to_trainer``   manifest appears → ``next_batch`` returns it to the trainer
``ack_to_release``     ``acked/<seq>`` appears → the next release directory appears
``bracket_pause``      ``control/pause-<v>`` → the last producer's ``ack-<v>``
``bracket_resume``     ``control/resume-<v>`` → the first claim after it
=====================  ==================================================================

Everything runs on one host (the demo): inotify hears every change made through the local
mount, and all processes share one monotonic clock, so the producers' own hop samples
(``claim_to_generate``, ``final_to_ready``) are comparable with the tracer's. Timestamps are
when the tracer *read* the event (it wakes on it; its lag is a few ms on a busy machine).

``idle_gaps`` finds the stretches in which the trainer waits for a batch and no engine is
generating while the run still has work: the dead time a hand-off leaves.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from strawq.data.cursor import CURSOR_DIR, cursor_at
from strawq.delivery.batches import BatchStore
from strawq.ondisk.names import STAGE_FRESH, TaskName
from strawq.storage.watch import IN_CREATE, IN_MOVED_TO, DirWatch, Event
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import RELEASE_PREFIX

log = logging.getLogger(__name__)

HOPS = ("release_to_claim", "claim_to_generate", "final_to_ready", "ready_to_batch",
        "batch_due", "batch_to_trainer", "ack_to_release", "bracket_pause", "bracket_resume")
WATCHED = ("pending", CURSOR_DIR, "leased", "ready", "batches", "acked", "control")


def histogram(values: Sequence[float]) -> dict[str, Any]:
    """count, p50, p90, p99, max and mean in milliseconds (rounded to 0.1 ms)."""
    xs = sorted(values)
    if not xs:
        return {"count": 0}

    def q(p: float) -> float:
        return round(1000 * xs[min(len(xs) - 1, math.ceil(p * len(xs)) - 1)], 1)

    return {"count": len(xs), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "max_ms": round(1000 * xs[-1], 1), "mean_ms": round(1000 * sum(xs) / len(xs), 1)}


@dataclass
class HopSamples:
    """Samples per hop (seconds) and the event times the timeline marks."""

    hops: dict[str, list[float]] = field(default_factory=lambda: {h: [] for h in HOPS})
    marks: dict[str, list[float]] = field(default_factory=dict)

    def add(self, hop: str, seconds: float) -> None:
        if seconds >= 0:
            self.hops.setdefault(hop, []).append(seconds)

    def mark(self, what: str, t: float) -> None:
        self.marks.setdefault(what, []).append(t)

    def summary(self) -> dict[str, dict[str, Any]]:
        return {h: histogram(v) for h, v in self.hops.items()}


class HopTracer(threading.Thread):
    """Watches one run directory (on this host) and records hop latencies as they happen."""

    def __init__(self, queue: RunQueue, *, clock: Any = time.monotonic) -> None:
        super().__init__(daemon=True, name="strawq-hop-tracer")
        self.queue = queue
        self.batches = BatchStore(queue)
        self.clock = clock
        self.samples = HopSamples()
        self.watch = DirWatch(queue.storage, WATCHED, mask=IN_CREATE | IN_MOVED_TO,
                              keep_events=True, clock=clock)
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._release_at: dict[int, float] = {}
        self._bounds: list[tuple[int, int]] = []  # (first index after release seq, seq)
        self._top_at: dict[tuple[str, int], float] = {}
        self._claim_at: dict[tuple[str, int], float] = {}
        self._ready_at: dict[tuple[str, int], float] = {}
        self._published_at: dict[int, float] = {}
        self._unanswered_ack: float | None = None
        self._last_ack_at = -math.inf
        self._pause_at: dict[int, float] = {}
        self._last_ack: dict[int, float] = {}
        self._resumed_at: float | None = None

    @property
    def event_driven(self) -> bool:
        return self.watch.event_driven

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.watch.wait(0.25)
            self.process(self.watch.take_events())

    def stop(self) -> HopSamples:
        self.stop_event.set()
        self.join(5)
        self.process(self.watch.take_events())
        self.watch.close()
        return self.samples

    # -- from other threads ------------------------------------------------------------------
    def returned(self, seq: int, t: float | None = None) -> None:
        """The trainer's ``next_batch`` returned batch ``seq`` (called by the trainer)."""
        t = self.clock() if t is None else t
        with self._lock:
            at = self._published_at.get(seq)
            if at is not None:
                self.samples.add("batch_to_trainer", t - at)

    def add_producer_hops(self, hops: dict[str, Iterable[float]]) -> None:
        with self._lock:
            for h, xs in hops.items():
                for x in xs:
                    self.samples.add(h, float(x))

    # -- events ------------------------------------------------------------------------------
    def process(self, events: list[Event]) -> None:
        with self._lock:
            for ev in events:
                try:
                    self._one(ev)
                except Exception:  # noqa: BLE001 - a tracer never takes the run down
                    log.debug("hop tracer: cannot use event %s", ev, exc_info=True)

    def _one(self, ev: Event) -> None:
        d, name, t = ev.directory, ev.name, ev.at
        if d == CURSOR_DIR:
            bound = self._cursor_bound(name)
            if bound is not None:
                bisect.insort(self._bounds, bound)
        elif d == "pending":
            if name.startswith(RELEASE_PREFIX):
                self._release_at[int(name[len(RELEASE_PREFIX):])] = t
                self.samples.mark("release", t)
                if self._unanswered_ack is not None:
                    self.samples.add("ack_to_release", t - self._unanswered_ack)
                    self._unanswered_ack = None
            else:
                n = TaskName.try_parse(name)
                if n is not None:
                    self._top_at[(n.id, n.gen)] = t
        elif d == "leased":
            self._claimed(name, t)
        elif d == "ready":
            n = TaskName.try_parse(name)
            if n is not None:
                self._ready_at[(n.id, n.gen)] = t
                self.samples.mark("ready", t)
        elif d == "batches" and name.isdigit():
            self._published(int(name), t)
        elif d == "acked" and name.isdigit():
            self._unanswered_ack = t
            self._last_ack_at = t
            self.samples.mark("ack", t)
        elif d == "control":
            self._control(name, t)

    def _cursor_bound(self, name: str) -> tuple[int, int] | None:
        """(next dataset index, seq) of a new cursor, from its name (``strawq.data.cursor``)."""
        at = cursor_at(self.queue.storage, name)
        return None if at is None else (at[1], at[0])

    def _claimed(self, name: str, t: float) -> None:
        n = TaskName.try_parse(name)
        if n is None:
            return
        self._claim_at[(n.id, n.gen)] = t
        self.samples.mark("claim", t)
        if self._resumed_at is not None:
            self.samples.add("bracket_resume", t - self._resumed_at)
            self._resumed_at = None
        at = self._top_at.pop((n.id, n.gen), None)
        if at is None and n.key.startswith(STAGE_FRESH) and n.id.startswith("i"):
            index = int(n.id[1:])
            k = bisect.bisect_right(self._bounds, (index, math.inf))
            if k < len(self._bounds):  # the first release whose end is past this index
                at = self._release_at.get(self._bounds[k][1])
        if at is not None:
            self.samples.add("release_to_claim", t - at)

    def _published(self, seq: int, t: float) -> None:
        self._published_at[seq] = t
        self.samples.mark("batch", t)
        try:
            man = self.batches.read_manifest(seq)
        except Exception:  # noqa: BLE001 - collected already: nothing to time
            return
        latest = None
        for g in man.groups:
            at = self._ready_at.pop((g.id, g.gen), None)
            if at is not None:
                self.samples.add("ready_to_batch", t - at)
                latest = at if latest is None else max(latest, at)
        if latest is not None:
            self.samples.add("batch_due", t - max(latest, self._last_ack_at))

    def _control(self, name: str, t: float) -> None:
        kind, _, rest = name.partition("-")
        version = int(rest.split("~", 1)[0]) if rest[:1].isdigit() else -1
        if kind == "pause":
            self._pause_at[version] = t
            self.samples.mark("pause", t)
        elif kind == "ack":
            self._last_ack[version] = t
        elif kind == "resume":
            self.samples.mark("resume", t)
            if version in self._pause_at and version in self._last_ack:
                self.samples.add("bracket_pause", self._last_ack[version]
                                 - self._pause_at[version])
            self._resumed_at = t


@dataclass(frozen=True)
class IdleGaps:
    count: int
    longest_s: float
    total_s: float
    gaps: list[tuple[float, float]]

    def to_dict(self, threshold_s: float) -> dict[str, Any]:
        return {"threshold_ms": round(1000 * threshold_s), "count": self.count,
                "longest_ms": round(1000 * self.longest_s, 1),
                "total_s": round(self.total_s, 3)}


def idle_gaps(waits: Sequence[tuple[float, float]],
              engine_samples: dict[str, list[tuple[float, float]]], *,
              threshold_s: float = 0.1, work_until: float | None = None) -> IdleGaps:
    """Stretches longer than ``threshold_s`` where the trainer waits and no engine runs.

    ``waits``: the trainer's wait intervals (it is busy outside them). ``engine_samples``:
    per engine, (t, busy fraction) samples; an engine is idle from a sample of 0 to its next
    sample. ``work_until``: the run has work until then (later idleness is the end).
    """
    idle_all = _all_idle(engine_samples)
    gaps: list[tuple[float, float]] = []
    for ws, we in waits:
        if work_until is not None:
            we = min(we, work_until)
        for a, b in idle_all:
            s, e = max(a, ws), min(b, we)
            if e - s > threshold_s:
                gaps.append((s, e))
    gaps.sort()
    return IdleGaps(len(gaps), max((e - s for s, e in gaps), default=0.0),
                    sum(e - s for s, e in gaps), gaps)


def _all_idle(engine_samples: dict[str, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Intervals in which every engine's latest sample says idle."""
    if not engine_samples:
        return []
    points = sorted({t for pts in engine_samples.values() for t, _ in pts})
    series = {k: sorted(v) for k, v in engine_samples.items()}
    times = {k: [t for t, _ in v] for k, v in series.items()}
    out: list[tuple[float, float]] = []
    start: float | None = None
    for t in points:
        idle = True
        for k, pts in series.items():
            i = bisect.bisect_right(times[k], t) - 1
            if i < 0 or pts[i][1] > 0:
                idle = False
                break
        if idle and start is None:
            start = t
        elif not idle and start is not None:
            out.append((start, t))
            start = None
    if start is not None:
        out.append((start, points[-1]))
    return out
