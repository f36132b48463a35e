"""A run's state at a glance: tasks per state, leases, producers, staleness, oldest item."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from strawq.batches import batch_seqs
from strawq.engine_weights import EngineWeights
from strawq.feeder import read_cursor_state
from strawq.staleness import staleness
from strawq.queue import RunQueue
from strawq.retention import drop_totals
from strawq.names import TaskName
from strawq.states import DIRS, RELEASE_PREFIX, TaskState, depths, names_in


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
    #: files in the state directories that are not tasks (ignored by the queue)
    stray_files: list[str] = field(default_factory=list)
    #: engines noted as on weights other than the run's (``engines/``): URL -> the newest
    #: note's engine version (None: unreadable), run version, writer and reason
    engines_needing_weights: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_status(queue: RunQueue) -> RunStatus:
    st = queue.storage
    out = RunStatus(current_version=queue.current_version())
    out.counts = asdict(depths(st))
    out.dropped_by_reason = drop_totals(st)  # dropped/ plus the compacted drop audit
    out.counts["dropped"] = sum(out.dropped_by_reason.values())
    names = {state.value: names_in(st, state) for state in (
        TaskState.PARTIAL, TaskState.PENDING, TaskState.LEASED, TaskState.READY)}
    by_producer: Counter[str] = Counter(t.producer for t in names["leased"] if t.producer)
    out.leases_by_producer = dict(by_producer)
    for p, c in queue.heartbeats():
        out.heartbeats[p] = max(out.heartbeats.get(p, 0), c)
    if names["ready"]:
        stal = [staleness(out.current_version, t.version) for t in names["ready"]]
        out.staleness = {"ready/mean": sum(stal) / len(stal), "ready/max": float(max(stal))}
    for state in ("partial", "pending", "ready"):
        if names[state]:
            out.oldest[state] = names[state][0].id
    seqs, acked = batch_seqs(st)
    out.batches_unacked = len(set(seqs) - acked)
    out.quarantined = len(st.list("quarantine"))
    out.stray_files = stray_files(queue)
    out.engines_needing_weights = {
        url: {"engine_version": n.engine_version, "run_version": n.run_version,
              "writer": n.writer, "reason": n.reason}
        for url, n in sorted(EngineWeights(st).needing().items())}
    cursor = read_cursor_state(st)
    if cursor is not None:
        out.cursor = {k: cursor[k] for k in ("seq", "next_index", "exhausted", "error")
                      if k in cursor}
    return out


def stray_files(queue: RunQueue, limit: int = 100) -> list[str]:
    """Keys in the state directories that are not task names (a ``junk.txt``): the queue
    ignores them, status names them so that an operator can remove them."""
    st = queue.storage
    out: list[str] = []
    for d in dict.fromkeys(DIRS.values()):
        for n in st.list(d):
            key = f"{d}/{n}"
            if d == DIRS[TaskState.PENDING] and n.startswith(RELEASE_PREFIX) and st.is_dir(key):
                out += [f"{key}/{m}" for m in st.list(key) if TaskName.try_parse(m) is None]
            elif TaskName.try_parse(n) is None:
                out.append(key)
            if len(out) >= limit:
                return out[:limit]
    return out
