"""A run's state at a glance: tasks per state, leases, producers, staleness, oldest item."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from strawq.data.cursor import read_cursor_state
from strawq.delivery.batches import BatchStore, batch_seqs, queue_depths
from strawq.delivery.retention import drop_totals
from strawq.ondisk.names import ChunkName, TaskName
from strawq.ondisk.staleness import staleness
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import DIRS, RELEASE_PREFIX, RELEASES, TaskState, names_in
from strawq.weights.engine_weights import EngineWeights

#: Free space under which a run's filesystem counts as full: any record write would fail
#: there (one ordinary record is a few KiB; a group's payload, more).
FULL_BELOW_BYTES = 64 * 1024
#: Share of the volume under which free space (or free inodes) is *low*: the collector
#: warns and ``strawq status`` says so while there is still room to act
#: (``CollectorConfig.disk_warn_share``).
LOW_SHARE = 0.05


def disk_space(storage: Storage, *, low_share: float = LOW_SHARE) -> dict[str, Any]:
    """``{"path", "free_bytes", "total_bytes", "free_ratio", "free_inodes", "full", "low"}``
    of the filesystem under a POSIX store (``statvfs``: what an unprivileged writer may still
    use, and its share of the volume); ``{}`` for a store with no local path or a filesystem
    that cannot say. ``low``: free space or inodes under ``low_share`` of the volume's (or
    the disk is full)."""
    path = storage.local_path("hb")
    if path is None:
        return {}
    root = os.path.dirname(path)
    try:
        st = os.statvfs(root)
    except OSError:
        return {}
    free = st.f_bavail * st.f_frsize
    inodes = st.f_favail if st.f_files else None  # 0 files: the filesystem does not count
    total = st.f_blocks * st.f_frsize
    full = free < FULL_BELOW_BYTES or inodes == 0
    low = full or free < low_share * total or (
        inodes is not None and inodes < low_share * st.f_files)
    return {"path": root, "free_bytes": free, "total_bytes": total,
            "free_ratio": free / total if total else None, "free_inodes": inodes,
            "full": full, "low": low}


def low_message(path: str, disk: dict[str, Any]) -> str:
    """The warning while the disk under a run runs low (before it is full)."""
    free, total = disk.get("free_bytes", 0), disk.get("total_bytes", 0) or 1
    return (f"the disk under {path} is running low: {free / 2**20:.1f} MiB free "
            f"({100 * free / total:.1f}% of the volume"
            + (f", {disk['free_inodes']} inodes" if disk.get("free_inodes") is not None
               else "") + f"). Act before it is full: strawq gc {path} (trained batches, "
            f"dead writers' files, abandoned release staging), strawq gc --expire {path} "
            "(also the compacted drops kept for strawq requeue), or raise the quota")


def run_label(storage: Storage) -> str:
    """The run's name in metrics (the ``run`` label): its directory's name."""
    path = storage.local_path("run.meta")
    if path is None:
        return storage.describe()
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def full_message(path: str) -> str:
    """The one line every part gives when the disk under a run is full."""
    return (f"the disk under {path} is full: free space (strawq gc {path} removes trained "
            "batches, dead writers' temporary files and abandoned release staging; "
            f"strawq gc --expire {path} also the compacted drops kept for strawq requeue) or "
            "raise the quota; nothing was lost, and producers and the collector retry and "
            "resume by themselves")


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
    #: the filesystem under the run (``disk_space``): free bytes and inodes, ``full``
    disk: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_status(queue: RunQueue) -> RunStatus:
    st = queue.storage
    out = RunStatus(current_version=queue.current_version())
    store = BatchStore(queue)  # reads each manifest once for the counts and the names
    out.counts = asdict(queue_depths(st, store=store))
    out.dropped_by_reason = drop_totals(st)  # dropped/ plus the compacted drop audit
    out.counts["dropped"] = sum(out.dropped_by_reason.values())
    names = {state.value: names_in(st, state) for state in (
        TaskState.PARTIAL, TaskState.PENDING, TaskState.LEASED)}
    batched = store.batched_names()  # listed before ready/ (batched_names)
    names["ready"] = [n for n in names_in(st, TaskState.READY) if str(n) not in batched]
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
    out.disk = disk_space(st)
    cursor = read_cursor_state(st)
    if cursor is not None:
        out.cursor = {k: cursor[k] for k in ("seq", "next_index", "exhausted", "error",
                                             "unread") if k in cursor}
        passes = queue.config.num_epochs
        if passes > 1:  # the pass it is in (1-based); exhausted only after the last
            done = max(len(cursor.get("epoch_bases") or ()), 1)
            out.cursor["pass"] = f"{done}/{passes}"
            out.cursor["exhausted"] = bool(cursor.get("exhausted")) and done >= passes
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
                seq = RELEASES.parse(n)
                out += [f"{key}/{m}" for m in st.list(key) if TaskName.try_parse(m) is None
                        and ChunkName.try_parse(m, seq) is None]  # a chunk: range claims
            elif d == DIRS[TaskState.LEASED] and ChunkName.try_parse(n) is not None:
                continue  # a held chunk (range claims)
            elif TaskName.try_parse(n) is None:
                out.append(key)
            if len(out) >= limit:
                return out[:limit]
    return out
