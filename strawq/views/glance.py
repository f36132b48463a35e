"""A run at a glance: who is alive, what is open, what is stalled and why.

``strawq status`` shows this; ``strawq.views.glance_text`` words it. Liveness is judged as the
grantor judges it (docs/design.md, invariant 3): from heartbeat *counters*, watched on this
process's own monotonic clock — never from file times, never by comparing two hosts' clocks.
So a one-shot look watches the counters for a short window (``Watcher.watch``: until every
party that should beat has beaten once, at most about one heartbeat interval), and an age is
either exact (the counter was seen to move: seconds since) or a lower bound (not seen to move
in the time watched). ``--watch`` keeps one ``Watcher`` across redraws, so its ages grow
exact and long.

A producer is, against the run's lease timeout T and liveness timeout L
(``QueueConfig.liveness_s``):

* **dead** — its process is known gone (same host, boot and pid namespace:
  ``strawq.liveness``), or its counter stayed still for T (T plus one heartbeat interval for
  an idle one, which beats once per T);
* **idle** — its heartbeat carries the idle mark (it holds no lease, claims nothing);
* **live** — not idle, and its counter moved within L;
* **silent** — not idle, and not seen to move for at least one heartbeat interval (it misses
  beats; dead at T);
* **unknown** — not watched long enough to say (``--sample 0``).

The collector is judged the same way from its epoch's heartbeat (``collector/hb-<E>~<n>``),
and is besides **none** (no epoch yet) or **stopped** (its epoch closed cleanly).

An open weight-update bracket's age is read from its pause record (the trainer's wall clock:
shown, never acted on). What is stalled, and why, is ``Glance.stalls``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strawq.errors import StrawqError
from strawq.liveness import known_dead, parse_identity
from strawq.ondisk import records
from strawq.ondisk.names import heartbeat_key, parse_heartbeat_state
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.epochs import HEARTBEATS as COLLECTOR_BEATS
from strawq.tasks.epochs import closed_name, epoch_key, epochs, list_names
from strawq.tasks.finished import finished as run_finished
from strawq.tasks.queue import RunQueue
from strawq.views.status import LOW_SHARE, RunStatus, run_status
from strawq.weights.control import PAUSES, ControlState, read_state

#: A bracket open this long is a stall even if it waits for nobody dead (a weight update
#: of a large model takes minutes, not ten).
BRACKET_STALL_S = 600.0
#: Free share of the volume under which the disk is reported as nearly full (as the
#: collector's warning, ``strawq.views.status.LOW_SHARE``).
DISK_LOW_RATIO = LOW_SHARE
#: The party ``Watcher`` keys the collector under (producer ids never hold a ``:``).
COLLECTOR = ":collector"


@dataclass
class _Seen:
    counter: int
    first_seen: float
    moved_at: float | None = None
    idle: bool = False
    key: str = ""


class Watcher:
    """Heartbeat counters of the producers and the collector, on this process's clock."""

    def __init__(self, storage: Storage, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.storage = storage
        self.clock = clock
        self.sleep = sleep
        self.seen: dict[str, _Seen] = {}
        self._gone: dict[str, tuple[tuple[str, int], bool]] = {}
        #: the collector's newest epoch and whether it closed, as last listed
        self.epoch = 0
        self.closed = False

    def look(self) -> None:
        """List ``hb/`` and ``collector/`` once and note every counter that moved."""
        now = self.clock()
        current: dict[str, tuple[int, bool, str]] = {}
        for n in self.storage.list("hb"):
            hb = parse_heartbeat_state(n)
            if hb is not None and hb[1] >= current.get(hb[0], (-1, False, ""))[0]:
                current[hb[0]] = (hb[1], hb[2], heartbeat_key(*hb))
        names = list_names(self.storage)
        known = epochs(names)
        epoch = known[-1] if known else 0
        if epoch != self.epoch:
            self.seen.pop(COLLECTOR, None)  # a new holder: its own counter
        self.epoch, self.closed = epoch, bool(epoch) and closed_name(epoch) in names
        if epoch:
            counter = max((c for e, c in COLLECTOR_BEATS.pairs(names) if e == epoch), default=0)
            current[COLLECTOR] = (counter, False, epoch_key(epoch))
        for party, (counter, idle, key) in current.items():
            s = self.seen.get(party)
            if s is None:
                self.seen[party] = _Seen(counter, now, None, idle, key)
                continue
            if counter != s.counter:
                s.counter, s.moved_at = counter, now
            s.idle, s.key = idle, key
        for party in set(self.seen) - set(current):
            del self.seen[party]  # the grantor forgot it (or the collector's epoch is gone)

    def age(self, party: str) -> tuple[float, bool]:
        """(seconds, exact): since the counter moved, or watched without a move (a bound)."""
        s = self.seen[party]
        if s.moved_at is not None:
            return self.clock() - s.moved_at, True
        return self.clock() - s.first_seen, False

    def gone(self, party: str) -> bool:
        """Whether the party's process is known gone (its record names a pid on this host)."""
        s = self.seen.get(party)
        if s is None:
            return False
        cached = self._gone.get(party)
        if cached is not None and cached[0] == (s.key, s.counter):
            return cached[1]  # read once per beat: a still party is not read again
        try:
            body = self.storage.read(s.key)
        except StrawqError:
            return False  # it moved meanwhile, or unreadable: the silence decides
        if party == COLLECTOR:
            try:
                gone = known_dead(records.decode(body, expect=Kind.EPOCH).meta)
            except StrawqError:
                gone = False
        else:
            gone = known_dead(parse_identity(body))
        self._gone[party] = ((s.key, s.counter), gone)
        return gone

    def watch(self, seconds: float, *, poll_s: float = 0.1) -> None:
        """Look until every party that should beat has been seen to move, or ``seconds``."""
        start = self.clock()
        self.look()
        while self.clock() - start < seconds:
            waiting = [p for p, s in self.seen.items() if s.moved_at is None and not s.idle
                       and not (p == COLLECTOR and self.closed) and not self.gone(p)]
            if not waiting:
                return
            self.sleep(min(poll_s, max(seconds - (self.clock() - start), 0.0)))
            self.look()


@dataclass
class Party:
    """A producer or the collector, judged."""

    name: str
    state: str
    #: seconds since its heartbeat moved (exact), or watched without a move (a bound)
    age_s: float | None = None
    age_exact: bool = False
    #: its process is known gone
    gone: bool = False
    leases: int = 0

    def why(self) -> str:
        """Its state in words: ``dead 9m, process gone``, ``live, beat 1.2s ago``."""
        if self.age_s is None:
            age = ""
        elif self.age_exact:
            age = f"beat {duration(self.age_s)} ago"
        else:
            age = f"no beat seen in {duration(self.age_s)}"
        if self.state == "dead":
            exact = self.age_exact and self.age_s is not None
            head = f"dead {duration(self.age_s)}" if exact else "dead"
            tail = "process gone" if self.gone else ("" if exact else age)
            return f"{head}, {tail}" if tail else head
        return f"{self.state}, {age}" if age else self.state


def judge(w: Watcher, party: str, *, lease_s: float, liveness_s: float,
          interval_s: float) -> tuple[str, float | None, bool, bool]:
    """(state, age, exact, gone) of a party ``w`` watched (see the module docstring)."""
    if party == COLLECTOR and w.closed:
        return "stopped", None, False, False
    s = w.seen[party]
    age, exact = w.age(party)
    gone = w.gone(party)
    if gone or age >= lease_s + (interval_s if s.idle else 0.0):
        return "dead", age, exact, gone
    if s.idle:
        return "idle", age, exact, False
    if exact:
        return ("live" if age < liveness_s else "silent"), age, True, False
    return ("silent" if age >= interval_s else "unknown"), age, False, False


@dataclass
class Bracket:
    open: bool
    version: int
    resume_version: int
    #: seconds since the pause was announced (the trainer's clock; None: unreadable)
    open_s: float | None = None
    acked: list[str] = field(default_factory=list)
    #: producers not idle that have not acked, with their state in words
    waiting: dict[str, str] = field(default_factory=dict)


def trainer_section(storage: Storage) -> dict[str, Any] | None:
    """The trainer's holder as the trainer fence records it (``strawq.tasks.trainer_epochs``);
    None when no trainer has held the run ("trainer: unknown")."""
    from strawq.tasks.trainer_epochs import read_trainer_holder

    holder = read_trainer_holder(storage)
    if holder is None:
        return None
    return {"state": "released" if holder.released else "holding", "epoch": holder.epoch,
            "host": holder.host, "pid": holder.pid,
            "heartbeat_age_s": holder.heartbeat_age_s, "detail": holder.describe()}


@dataclass
class Glance:
    path: str
    status: RunStatus
    producers: list[Party] = field(default_factory=list)
    collector: Party | None = None
    collector_epoch: int = 0
    bracket: Bracket | None = None
    trainer: dict[str, Any] | None = None
    #: what is stalled and why, one phrase each (empty: nothing)
    stalls: list[str] = field(default_factory=list)
    #: seconds the heartbeats were watched for this look
    watched_s: float = 0.0
    #: the run's "finished" record (``strawq.tasks.finished``): it drained; None while it goes on
    finished: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        out = self.status.to_dict()
        out.update(
            producers={p.name: {k: v for k, v in asdict(p).items() if k != "name"}
                       for p in self.producers},
            collector={"epoch": self.collector_epoch,
                       **({k: v for k, v in asdict(self.collector).items() if k != "name"}
                          if self.collector else {"state": "none"})},
            bracket=asdict(self.bracket) if self.bracket else None,
            trainer=self.trainer or {"state": "unknown"}, stalls=list(self.stalls),
            watched_s=self.watched_s, finished=self.finished)
        return out


def default_sample_s(queue: RunQueue) -> float:
    """How long a one-shot look watches heartbeats: one interval and a little (at most 10s);
    it ends sooner once every party that should beat has."""
    return min(queue.config.heartbeat_interval_s * 1.2 + 0.2, 10.0)


def _bracket(storage: Storage, st: ControlState, wall: Callable[[], float]) -> Bracket:
    b = Bracket(open=st.paused, version=st.pause_version, resume_version=st.resume_version,
                acked=sorted(st.acks))
    if st.paused:
        try:
            rec = records.decode(storage.read(f"control/{PAUSES.name(st.pause_version)}"),
                                 expect=Kind.STATE)
            at = rec.meta.get("at")
            if isinstance(at, (int, float)):
                b.open_s = max(wall() - float(at), 0.0)
        except StrawqError:
            pass
    return b


def glance(queue: RunQueue, path: str, watcher: Watcher, *, sample_s: float = 0.0,
           wall: Callable[[], float] = time.time) -> Glance:
    """Look at the run once (watching heartbeats for up to ``sample_s`` first)."""
    cfg = queue.config
    t0 = watcher.clock()
    if sample_s > 0:
        watcher.watch(sample_s)
    else:
        watcher.look()
    g = Glance(path=path, status=run_status(queue), watched_s=watcher.clock() - t0)
    limits = {"lease_s": cfg.lease_timeout_s, "liveness_s": cfg.liveness_s,
              "interval_s": cfg.heartbeat_interval_s}
    for p in sorted(watcher.seen):
        state, age, exact, gone = judge(watcher, p, **limits)
        party = Party(p, state, age, exact, gone, g.status.leases_by_producer.get(p, 0))
        if p == COLLECTOR:
            g.collector, party.name = party, "collector"
        else:
            g.producers.append(party)
    g.collector_epoch = watcher.epoch
    g.bracket = _bracket(queue.storage, read_state(queue.storage), wall)
    if g.bracket.open:
        g.bracket.waiting = {p.name: p.why() for p in g.producers
                             if p.name not in g.bracket.acked and p.state != "idle"}
    g.trainer = trainer_section(queue.storage)
    try:
        g.finished = run_finished(queue.storage)
    except StrawqError:
        g.finished = None  # an unreadable record: judged as a run that goes on
    g.stalls = stalls(g, cfg.liveness_s)
    return g


def stalls(g: Glance, liveness_s: float) -> list[str]:
    """What is stalled and why, one phrase each."""
    out: list[str] = []
    st = g.status
    c = st.counts
    if g.finished is not None:  # drained: parts stopping is the end, not a stall
        return _disk_stall(st.disk)
    work = sum(c.get(k, 0) for k in ("pending", "partial", "leased", "ready")) > 0 or (
        bool(st.cursor) and not st.cursor.get("exhausted"))
    b = g.bracket
    if b is not None and b.open:
        stuck = [f"{p} ({why})" for p, why in b.waiting.items()
                 if not why.startswith("live")]
        long_open = b.open_s is not None and b.open_s >= BRACKET_STALL_S
        if stuck and (b.open_s is None or b.open_s >= liveness_s) or long_open:
            age = f" {duration(b.open_s)}" if b.open_s is not None else ""
            tail = (f", waiting for {', '.join(stuck)}" if stuck else
                    f", waiting for {', '.join(b.waiting)}" if b.waiting else
                    ", every producer acked: the trainer has not resumed")
            out.append(f"bracket for version {b.version} open{age}{tail}")
    live = [p for p in g.producers if p.state == "live"]
    if not live and work and not (b is not None and b.open):
        counts = {s: sum(p.state == s for p in g.producers) for s in ("idle", "silent", "dead")}
        said = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        out.append("no live producer" + (f" ({said})" if said else " (none has beaten)"))
    col = g.collector
    if col is None:
        out.append("no collector has run on this run")
    elif col.state == "dead":
        out.append(f"collector {col.why()}")
    elif col.state == "stopped" and work:
        out.append(f"collector stopped (epoch {g.collector_epoch} closed) with work left")
    elif col.state == "silent":
        out.append(f"collector {col.why()}")
    return out + _disk_stall(st.disk)


def _disk_stall(d: dict[str, Any]) -> list[str]:
    ratio = d.get("free_ratio")
    if d.get("full") or d.get("low") or (isinstance(ratio, float) and ratio < DISK_LOW_RATIO):
        used = f"{(1 - ratio) * 100:.0f}% full" if isinstance(ratio, float) else "full"
        return [f"disk {used} ({size(int(d.get('free_bytes', 0)))} free)"]
    return []


def duration(seconds: float | None) -> str:
    """``4.2s``, ``12m 5s``, ``3h 7m``."""
    if seconds is None:
        return "?"
    s = max(seconds, 0.0)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m {sec}s" if m < 10 and sec else f"{m}m"
    h, m = divmod(m, 60)
    return f"{h}h {m}m" if m else f"{h}h"


def size(n: int) -> str:
    """``512 B``, ``12.3 GiB``."""
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{n} B"
