"""A run's state at a glance: tasks per state, leases, producers, staleness, oldest item."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from strawq.feeder import read_cursor_state
from strawq.names import TaskName
from strawq.queue import RunQueue


@dataclass
class RunStatus:
    counts: dict[str, int] = field(default_factory=dict)
    leases_by_producer: dict[str, int] = field(default_factory=dict)
    heartbeats: dict[str, int] = field(default_factory=dict)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    current_version: int = 0
    staleness: dict[str, float] = field(default_factory=dict)
    oldest: dict[str, str] = field(default_factory=dict)
    cursor: dict[str, Any] = field(default_factory=dict)
    batches_unacked: int = 0
    quarantined: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_status(queue: RunQueue) -> RunStatus:
    st = queue.storage
    out = RunStatus(current_version=queue.current_version())
    pending = [k.rsplit("/", 1)[1] for k in queue.list_pending()]
    names = {
        "pending": [n for n in pending if not n.startswith("a")],
        "partial": [n for n in pending if n.startswith("a")],
        "leased": st.list("leased"),
        "ready": st.list("ready"),
        "batched": st.list("batched"),
        "dropped": st.list("dropped"),
    }
    out.counts = {k: len(v) for k, v in names.items()}
    by_producer: Counter[str] = Counter()
    for n in names["leased"]:
        t = TaskName.try_parse(n)
        if t and t.producer:
            by_producer[t.producer] += 1
    out.leases_by_producer = dict(by_producer)
    reasons: Counter[str] = Counter()
    for n in names["dropped"]:
        t = TaskName.try_parse(n)
        reasons[t.producer if t and t.producer else "?"] += 1
    out.dropped_by_reason = dict(reasons)
    for n in st.list("hb"):
        p, _, c = n.rpartition("~")
        if c.isdigit():
            out.heartbeats[p] = max(out.heartbeats.get(p, 0), int(c))
    ready = [t for t in map(TaskName.try_parse, names["ready"]) if t is not None]
    if ready:
        stal = [out.current_version - t.version for t in ready]
        out.staleness = {"ready/mean": sum(stal) / len(stal), "ready/max": float(max(stal))}
    for state in ("partial", "pending", "ready"):
        if names[state]:
            first = TaskName.try_parse(names[state][0])
            if first:
                out.oldest[state] = first.id
    seqs = {n for n in st.list("batches") if n.isdigit()}
    acked = {n for n in st.list("acked") if n.isdigit()}
    out.batches_unacked = len(seqs - acked)
    out.quarantined = len(st.list("quarantine"))
    cursor = read_cursor_state(st)
    if cursor is not None:
        out.cursor = {k: cursor[k] for k in ("seq", "next_index", "exhausted", "error")
                      if k in cursor}
    return out
