"""What a run keeps on disk, and the collection of everything else (docs/design.md, invariant 6).

A run directory holds live records only: work in flight, groups not yet trained, and what
is kept on purpose (quarantined records, the drop audit, a few cursors, versions and
control records). ``BatchStore.gc`` retires acked batches; this module does the rest:

* ``compact_drops`` folds ``dropped/`` entries and their notes into the drop audit
  (DROPPED -> COMPACTED, ``strawq.tasks.states``),
  ``audit/drops-<seq>``: immutable segments, each one holding the cumulative counts per
  reason and the drops it took in. A segment is published (exclusive create: a second
  compactor loses) before the entries it names are deleted, and the next compaction first
  finishes those deletions, so a crash in between neither loses nor double-counts a drop.
  Past ``MAX_SEGMENTS`` the segments are merged into one (the newest ``KEEP_DETAILS``
  drops stay in detail; the counts are always complete). A folded entry's task record is
  not deleted: it moves to ``audit/kept/<day>/`` (the day it was folded in), where
  ``strawq requeue`` still finds it, for ``KEEP_DROPS_DAYS`` days; ``expire_kept`` (every
  GC: past the window; ``strawq gc --expire``: all of them) deletes it after that.
* ``sweep_payloads`` removes ``data/`` records that no live entry needs: payloads and notes
  of trained or compacted tasks, and payloads of generations that were fenced off.
  ``data/`` is listed *before* the state directories, so a record whose task is alive at
  the first listing is seen alive at the second (work flows one way; a task that leaves
  every directory in between was trained, and its records are garbage).
* ``sweep_turns`` removes the turn checkpoints (``strawq.tasks.turns``) of tasks that no longer
  need them: a holder deletes its task's checkpoints when it hands the lease back, but one
  killed between the hand-back and that deletion leaves them behind. A task keeps its
  checkpoints while it is pending, partial, leased or dropped (a re-lease, or an operator's
  ``strawq requeue``, resumes from them); once it is ready, batched or trained its group is
  persisted elsewhere. ``turns/`` is listed first, for the reason ``data/`` is.
* ``sweep_staging`` removes release staging (``staging/``) that no release will commit: at
  or below the newest committed cursor (its writer lost or died, as ``Feeder.recover``
  does), or older than a grace by its mtime (a release refused or killed before its
  commit); the newest cursor's own staging (committed, its promotion pending) is kept.
* ``live_files`` counts files per top-level directory (``bench/queue_ops.py``, tests).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from strawq.data.cursor import PREPARED, cursor_key, list_cursors, newest_seq
from strawq.data.history import attempt_row, record_attempts
from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import TaskName, note_key
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.states import (
    LEGACY_TRAINED,
    RELEASES,
    TaskState,
    entries,
    key_of,
    move,
    names_in,
    retire,
)
from strawq.tasks.turns import TURNS_DIR

log = logging.getLogger(__name__)

AUDIT_DIR = "audit"
SEGMENT_PREFIX = "drops-"
#: ``audit/drops-<seq>``
SEGMENTS = Numbered(SEGMENT_PREFIX)
#: Segments before they are merged into one.
MAX_SEGMENTS = 16
#: Drops kept in detail (id, reason, message) by a merge; counts are never truncated.
KEEP_DETAILS = 10_000
#: ``audit/kept/<day>/<name>``: the task records of compacted drops, by the day (UTC days
#: since the epoch) they were folded in, for ``strawq requeue``
KEPT_DIR = f"{AUDIT_DIR}/kept"
DAYS = Numbered(width=8)
#: Days a compacted drop stays requeueable (``strawq gc --expire`` ends it at once).
KEEP_DROPS_DAYS = 7
DAY_S = 86_400.0
#: States whose entries keep a task's records alive, listed in the direction work flows.
LIVE_STATES = (TaskState.PENDING, TaskState.PARTIAL, TaskState.LEASED, TaskState.READY,
               TaskState.BATCHED, TaskState.DROPPED)


@dataclass
class DropAudit:
    """The newest segment of the drop audit (empty when nothing was compacted yet)."""

    seq: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    compacted: list[str] = field(default_factory=list)
    drops: list[dict[str, Any]] = field(default_factory=list)


def _segments(storage: Storage) -> list[int]:
    return SEGMENTS.numbers(storage.list(AUDIT_DIR))


def _key(seq: int) -> str:
    return f"{AUDIT_DIR}/{SEGMENTS.name(seq)}"


def _read(storage: Storage, seq: int) -> DropAudit:
    rec = records.decode(storage.read(_key(seq)), expect=Kind.STATE, name=_key(seq))
    m = rec.meta
    counts, compacted, drops = m.get("counts", {}), m.get("compacted", []), m.get("drops", [])
    if not (isinstance(counts, dict) and isinstance(compacted, list) and isinstance(drops, list)):
        raise CorruptRecord(f"{_key(seq)}: expected counts (map), compacted and drops (lists), "
                            f"found {type(counts).__name__}, {type(compacted).__name__}, "
                            f"{type(drops).__name__}")
    return DropAudit(seq, dict(counts), list(compacted), list(drops))


def latest_audit(storage: Storage) -> DropAudit:
    """The newest readable segment (a corrupt one is skipped with an error)."""
    for seq in reversed(_segments(storage)):
        try:
            return _read(storage, seq)
        except (CorruptRecord, NotFound) as exc:
            log.error("drop audit segment %s is unreadable (%s); using an older one",
                      _key(seq), exc)
    return DropAudit()


def drop_totals(storage: Storage) -> dict[str, int]:
    """Dropped tasks per reason over the whole run: the audit's counts plus ``dropped/``."""
    audit = latest_audit(storage)
    done = set(audit.compacted)
    out = Counter(audit.counts)
    out.pop(LEGACY_TRAINED, None)  # an older run's trained groups, compacted: not drops
    for name in names_in(storage, TaskState.DROPPED):
        if str(name) not in done:
            out[name.producer or "unknown"] += 1
    return dict(sorted(out.items()))


def find_drop(storage: Storage, task_id: str) -> dict[str, Any] | None:
    """The audit's row for a compacted drop of ``task_id`` (newest first), or None."""
    for seq in reversed(_segments(storage)):
        try:
            audit = _read(storage, seq)
        except (CorruptRecord, NotFound):
            continue
        for row in reversed(audit.drops):
            if row.get("id") == task_id:
                return dict(row, segment=_key(seq))
    return None


def _today() -> int:
    return int(time.time() // DAY_S)


def _delete_dropped(storage: Storage, names: Iterable[TaskName]) -> None:
    """DROPPED -> COMPACTED for drops the audit holds: the note goes, the entry (the task
    record) moves to ``audit/kept/<today>/`` (idempotent: a missing entry is skipped)."""
    names = list(names)
    if not names:
        return
    day = f"{KEPT_DIR}/{DAYS.name(_today())}"
    storage.makedirs(day)
    for name in names:
        storage.delete(note_key(name.id, name.gen, "drop", name.producer or ""))
        retire(storage, name, TaskState.DROPPED, TaskState.COMPACTED, keep_at=f"{day}/{name}")
    storage.sync_dirs([day, key_of(TaskState.DROPPED, names[0]).rpartition("/")[0]])


def kept_drops(storage: Storage, reason: str | None = None) -> list[tuple[str, TaskName]]:
    """(key, name) of the compacted drops still kept (of ``reason``), oldest day first."""
    out: list[tuple[str, TaskName]] = []
    for day in DAYS.numbers(storage.list(KEPT_DIR)):
        d = f"{KEPT_DIR}/{DAYS.name(day)}"
        for n in storage.list(d):
            name = TaskName.try_parse(n)
            if name is not None and (reason is None or name.producer == reason):
                out.append((f"{d}/{n}", name))
    return out


def restore_kept(storage: Storage, key: str, name: TaskName, new: TaskName) -> str:
    """COMPACTED -> PENDING: a kept task record back into the queue as ``new`` (one rename;
    ``NotFound`` when another mover or the expiry took it first)."""
    return move(storage, name, TaskState.COMPACTED, TaskState.PENDING, new, src_key=key,
                sync_dir=False)


def expire_kept(storage: Storage, *, keep_days: float = KEEP_DROPS_DAYS) -> int:
    """Delete the kept task records folded in more than ``keep_days`` days ago (0: all of
    them); they can no longer be requeued. Returns how many were deleted."""
    removed = 0
    horizon = _today() - keep_days if keep_days > 0 else float("inf")
    for day in DAYS.numbers(storage.list(KEPT_DIR)):
        if day >= horizon:
            continue
        d = f"{KEPT_DIR}/{DAYS.name(day)}"
        for n in storage.list(d):
            storage.delete(f"{d}/{n}")
            removed += 1
        storage.rmdir(d)
    if removed:
        log.info("%d compacted drops expired: they can no longer be requeued", removed)
    return removed


def _row(storage: Storage, name: TaskName) -> dict[str, Any]:
    row: dict[str, Any] = {"id": name.id, "gen": name.gen, "attempts": name.attempts,
                           "reason": name.producer or "unknown"}
    key = note_key(name.id, name.gen, "drop", name.producer or "")
    try:
        note = records.decode(storage.read(key), expect=Kind.DROP, name=key).meta
    except NotFound:
        row["message"] = "(no note)"
        return row
    except CorruptRecord as exc:
        row["message"] = f"(note unreadable: {exc})"
        return row
    row["message"] = str(note.get("message", ""))
    row["at"] = note.get("at")
    if note.get("summary"):
        row["summary"] = note["summary"]
    return row


def _history_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [attempt_row(
        {"task_id": r["id"], **(r["summary"] if isinstance(r.get("summary"), dict) else {})},
        gen=r["gen"], status="dropped", reason=r["reason"], at=r.get("at")) for r in rows]


def record_drops(storage: Storage, seen: set[str]) -> int:
    """Record the ``dropped/`` entries not in ``seen`` in the per-prompt history now, without
    folding them into the audit (they stay requeueable), so the next pass's history rules
    see a dropped group's rewards (a filter's ``zero_variance`` drop) before ``compact_drops``
    runs; ``seen`` (the entries recorded so far) is updated. The compaction records them
    again later: the history counts each (task id, generation) once."""
    names = dict(entries(storage, TaskState.DROPPED))
    live = {str(n) for n in names.values()}
    seen &= live  # entries compacted or requeued since: forgotten
    todo = [n for n in names.values() if str(n) not in seen]
    if not todo or not record_attempts(storage, _history_rows(_row(storage, n) for n in todo)):
        return 0
    seen.update(str(n) for n in todo)
    return len(todo)


def compact_drops(storage: Storage) -> int:
    """Fold every ``dropped/`` entry into the audit; returns how many were folded in."""
    audit = latest_audit(storage)
    done = set(audit.compacted)
    finished = [name for _k, name in entries(storage, TaskState.DROPPED) if str(name) in done]
    _delete_dropped(storage, finished)  # a crash after the last segment was published
    todo = [name for _k, name in entries(storage, TaskState.DROPPED) if str(name) not in done]
    if not todo:
        return 0
    rows = [_row(storage, n) for n in todo]
    # the per-prompt history, before the notes go
    record_attempts(storage, _history_rows(rows))
    counts = Counter(audit.counts)
    counts.update(r["reason"] for r in rows)
    segs = _segments(storage)
    merge = len(segs) >= MAX_SEGMENTS
    drops = rows
    if merge:
        older: list[dict[str, Any]] = []
        for seq in segs:
            try:
                older += _read(storage, seq).drops
            except (CorruptRecord, NotFound):
                continue
        drops = (older + rows)[-KEEP_DETAILS:]
    seq = max(segs, default=0) + 1
    body = {"counts": dict(counts), "compacted": [str(n) for n in todo], "drops": drops,
            "merged": merge, "at": time.time()}
    try:
        storage.publish(_key(seq), records.encode(Kind.STATE, body))
    except AlreadyExists:
        log.warning("another process compacted the drop audit first (segment %d); skipping",
                    seq)
        return 0
    _delete_dropped(storage, todo)
    if merge:
        for old in segs:
            storage.delete(_key(old))
    return len(todo)


def sweep_payloads(storage: Storage) -> int:
    """Delete ``data/`` records no live entry needs; returns how many were deleted."""
    listed = storage.list("data")  # first: see the module docstring
    live: dict[str, list[TaskName]] = {}
    for state in LIVE_STATES:
        for name in names_in(storage, state):
            live.setdefault(name.id, []).append(name)
    removed = 0
    for n in listed:
        tid, sep, rest = n.partition("~g")
        gen_s, _, suffix = rest.partition(".")
        if not sep or not gen_s.isdigit():
            continue  # not a record this module knows: leave it
        gen, kind = int(gen_s), suffix.partition(".")[0]
        names = live.get(tid)
        if names is None:
            keep = False  # trained, or its drop was compacted
        elif kind == "group":
            keep = any(gen >= t.gen for t in names)
        elif kind == "partial":
            keep = any(gen >= t.gen or gen == t.resume for t in names)
        else:
            keep = True  # notes of a live task
        if not keep:
            storage.delete(f"data/{n}")
            removed += 1
    return removed


#: States in which a task may still resume from its turn checkpoints.
TURN_STATES = (TaskState.PENDING, TaskState.PARTIAL, TaskState.LEASED, TaskState.DROPPED)


def sweep_turns(storage: Storage) -> int:
    """Delete the turn checkpoints of tasks that cannot resume from them (see the module
    docstring); returns how many records were deleted."""
    listed = storage.list(TURNS_DIR)  # first: see the module docstring
    if not listed:
        return 0
    resumable = {name.id for state in TURN_STATES for name in names_in(storage, state)}
    removed = 0
    for tid in listed:
        if tid in resumable:
            continue
        d = f"{TURNS_DIR}/{tid}"
        if not storage.is_dir(d):
            continue  # not a record this module knows: leave it
        for n in storage.list(d):
            storage.delete(f"{d}/{n}")
            removed += 1
        storage.rmdir(d)
    return removed


STAGING_DIR = "staging"


def _committed_staging(storage: Storage) -> str | None:
    """The staging the newest cursor record names (a committed release, maybe not yet
    promoted); None when it names none or cannot be read (then nothing above the newest
    number is judged by it)."""
    newest = list_cursors(storage, newest_only=True)
    if not newest:
        return None
    key = cursor_key(newest[-1][2])
    try:
        staging = records.decode(storage.read(key), expect=Kind.CURSOR, name=key).meta.get(
            "staging")
    except (CorruptRecord, NotFound):
        return None
    return staging if isinstance(staging, str) else None


def sweep_staging(storage: Storage, *, grace_s: float = 3600.0) -> int:
    """Delete abandoned release staging (see the module docstring); returns the files
    deleted. ``grace_s``: the age past which staging above the newest cursor is abandoned
    (a release takes seconds to stage)."""
    listed = storage.list(STAGING_DIR)
    if not listed:
        return 0
    keep = _committed_staging(storage)
    committed = newest_seq(storage)
    now, removed = time.time(), 0
    for name in listed:
        if name == keep:
            continue
        number = RELEASES.parse(name)
        number = PREPARED.parse(name) if number is None else number
        d = f"{STAGING_DIR}/{name}"
        if number is None or number > committed:
            path = storage.local_path(d)
            try:
                old = path is not None and now - os.stat(path).st_mtime >= grace_s
            except OSError:
                old = False
            if not old:
                continue  # another writer's release in progress, maybe
        if not storage.is_dir(d):
            continue
        for f in storage.list(d):
            if storage.is_dir(f"{d}/{f}"):  # a chunk directory (queue.release_chunk)
                for g in storage.list(f"{d}/{f}"):
                    storage.delete(f"{d}/{f}/{g}")
                    removed += 1
                storage.rmdir(f"{d}/{f}")
                continue
            storage.delete(f"{d}/{f}")
            removed += 1
        storage.rmdir(d)
        log.info("removed abandoned release staging %s", d)
    return removed


def live_files(storage: Storage) -> dict[str, int]:
    """Files per top-level directory of the run (release directories count their tasks; a
    chunk directory, ``queue.release_chunk``, counts as one)."""
    out: dict[str, int] = {}
    for top in storage.list(""):
        if not storage.is_dir(top):
            continue
        n = 0
        for child in storage.list(top):
            key = f"{top}/{child}"
            n += len(storage.list(key)) if storage.is_dir(key) else 1
        out[top] = n
    return out
