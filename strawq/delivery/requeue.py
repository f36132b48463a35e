"""Dropped tasks back into the queue, by reason: ``strawq requeue RUN --reason R``.

A task dropped for a cause that is gone (a misconfigured producer, an engine outage that
spent its attempts, a filter since fixed) can run again. ``requeue_dropped`` moves each
entry ``dropped/<name>~<reason>`` to the top of ``pending/`` (DROPPED -> PENDING in
``strawq.tasks.states``) as a fresh generation: gen + 1 (a result of the dropped generation is
fenced out, as after any re-queue), no attempt spent, no regeneration counted, no prefix
(its sampling seeds are fresh), at its dataset order among the returned tasks.

Nothing is erased: the drop's note (``data/<id>~g<gen>.drop.<reason>``) stays, and a
``requeue`` note of the new generation records where the task came from
(``data/<id>~g<gen+1>.requeue.<reason>``); both live as long as the task's other notes.

Beside a live run: each move is one atomic rename of the task's single file, so a task is
in exactly one state at every moment and is trained at most once (docs/design.md,
invariant 1); a second requeue of the same task loses the rename and skips it. Producers
claim a requeued task like any returned one; the collector's admission counts it as
running. The one writer that also removes ``dropped/`` entries is the drop compaction
(``strawq.delivery.retention.compact_drops``): an entry it has already folded into the drop audit
is requeued from the audit's kept records (below); one it folds in while it is
being requeued is counted by the audit as dropped, so the requeue publishes a correcting
audit segment that takes it out of the counts again (and keeps the audit's list of
compacted entries). A compaction that listed the entry before the move but publishes its
segment only after the requeue's check still counts it: the audit's count of that reason
is then one high per such task (the task itself is in one state, and trained once).
Requeue while no compaction runs (``dropped/`` below the collector's ``COMPACT_DROPS_AT``
entries, no ``strawq gc``) and the counts are exact.

A drop the compaction already folded in is still requeued while its task record is kept
(``audit/kept/``, ``strawq.delivery.retention.KEEP_DROPS_DAYS`` days, until ``strawq gc --expire``):
COMPACTED -> PENDING by the same one rename, then an audit segment takes it out of the
counts (``requeued``). Once expired, it is gone and counted in ``compacted``.

Rows that failed validation at release (``bad_row``) have no task to run and are refused:
fix the rows and release them again (docs/datasets.md).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from strawq.delivery.retention import AUDIT_DIR, SEGMENTS, kept_drops, latest_audit, restore_kept
from strawq.errors import AlreadyExists, CorruptRecord, NotFound, StrawqError
from strawq.ondisk import records
from strawq.ondisk.names import STAGE_REQUEUED, TaskName, queue_key, validate_id
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import LEGACY_TRAINED, TaskState, entries, move

log = logging.getLogger(__name__)

#: Drops that have no task record to run again (``Feeder`` publishes them straight into
#: ``dropped/``).
NOT_REQUEUABLE = {"bad_row": "rows that failed validation at release have no task to run: "
                             "fix the rows and release them again (docs/datasets.md)",
                  LEGACY_TRAINED: "an older strawq recorded the groups a framework trained "
                                  "itself (slime's data source) as dropped with this reason: "
                                  "they are trained, and requeueing them would train them "
                                  "twice"}
#: The kind of the note a requeue writes (``data/<id>~g<gen>.requeue.<reason>``).
NOTE_KIND = "requeue"


@dataclass
class RequeueReport:
    """What ``requeue_dropped`` did (or, with ``dry_run``, would do)."""

    reason: str
    dry_run: bool = False
    #: task ids put back (would be put back) into the queue
    requeued: list[str] = field(default_factory=list)
    #: task ids another mover took first (compacted, or a concurrent requeue)
    skipped: list[str] = field(default_factory=list)
    #: drops of this reason folded into the drop audit whose task record expired: gone
    compacted: int = 0
    #: task ids requeued from the drop audit's kept records (a subset of ``requeued``)
    from_audit: list[str] = field(default_factory=list)
    #: entries the drop compaction took into the audit while they were requeued (the
    #: audit's counts were corrected)
    corrected: list[str] = field(default_factory=list)


def requeued_from_drop(name: TaskName) -> TaskName:
    """The queued name of dropped ``name``: gen + 1, attempts and regenerations 0, no
    prefix, stage ``b`` (returned) at version 0 and its dataset order, no holder."""
    return TaskName(key=queue_key(STAGE_REQUEUED, 0, name.order), id=name.id, gen=name.gen + 1,
                    attempts=0, resume=-1, producer=None, regenerations=0)


def requeue_dropped(queue: RunQueue, reason: str, *, dry_run: bool = False,
                    limit: int | None = None) -> RequeueReport:
    """Put the tasks dropped with ``reason`` back into the queue (at most ``limit``).

    ``StrawqError`` for a reason whose drops have no task to run (``bad_row``). A report
    with nothing requeued when no entry in ``dropped/`` has the reason."""
    validate_id(reason, "reason")
    if reason in NOT_REQUEUABLE:
        raise StrawqError(f"drops with reason {reason!r} cannot be requeued: "
                          f"{NOT_REQUEUABLE[reason]}")
    storage = queue.storage
    rep = RequeueReport(reason, dry_run=dry_run)
    audit_seq = latest_audit(storage).seq  # before the listing: see _correct_audit
    todo = [name for _key, name in entries(storage, TaskState.DROPPED)
            if name.producer == reason][:limit]
    kept = kept_drops(storage, reason)
    rep.compacted = max(0, int(latest_audit(storage).counts.get(reason, 0)) - len(kept))
    kept = kept[:None if limit is None else max(0, limit - len(todo))]
    if dry_run:
        rep.requeued = [n.id for n in todo] + [n.id for _k, n in kept]
        rep.from_audit = [n.id for _k, n in kept]
        return rep
    moved: list[TaskName] = []
    for name in todo:
        new = requeued_from_drop(name)
        queue.write_note(new, NOTE_KIND, reason,
                         f"requeued from dropped/{name} by strawq requeue (reason {reason})")
        try:
            move(storage, name, TaskState.DROPPED, TaskState.PENDING, new, sync_dir=False)
        except NotFound:  # compacted, or requeued by another process, since the listing
            rep.skipped.append(name.id)
            continue
        moved.append(name)
        rep.requeued.append(name.id)
    if moved:
        storage.sync_dirs(["pending", "dropped"])
        rep.corrected = _correct_audit(storage, moved, audit_seq)
    restored = []
    for key, name in kept:
        new = requeued_from_drop(name)
        queue.write_note(new, NOTE_KIND, reason,
                         f"requeued from the drop audit ({key}) by strawq requeue")
        try:
            restore_kept(storage, key, name, new)
        except NotFound:  # expired, or requeued by another process, since the listing
            rep.skipped.append(name.id)
            continue
        restored.append(name)
        rep.requeued.append(name.id)
        rep.from_audit.append(name.id)
    if restored:
        storage.sync_dirs(["pending"])
        _uncount(storage, restored)
    log.info("requeued %d tasks dropped with reason %s (%d taken by another mover)",
             len(rep.requeued), reason, len(rep.skipped))
    return rep


def _uncount(storage: Storage, names: list[TaskName]) -> None:
    """Publish an audit segment that takes ``names`` (requeued from the kept records) out
    of the drop counts."""
    for _attempt in range(10):
        latest = latest_audit(storage)
        counts = Counter(latest.counts)
        counts.subtract(n.producer or "unknown" for n in names)
        body = {"counts": {k: v for k, v in counts.items() if v > 0},
                "compacted": latest.compacted, "drops": [], "merged": False,
                "requeued": [str(n) for n in names], "at": time.time()}
        try:
            storage.publish(_segment_key(latest.seq + 1), records.encode(Kind.STATE, body))
            return
        except AlreadyExists:  # another compaction first: count again
            continue
    log.error("could not publish the drop audit's correction for %d requeued tasks (10 "
              "compactions raced it); its counts of reason %s stay %d high", len(names),
              names[0].producer, len(names))


def _segment_key(seq: int) -> str:
    return f"{AUDIT_DIR}/{SEGMENTS.name(seq)}"


def _correct_audit(storage: Storage, moved: list[TaskName], since: int) -> list[str]:
    """Take the ``moved`` entries out of the drop audit's counts where a compaction that
    ran during the requeue (a segment newer than ``since``) took them in."""
    wanted = {str(n): n for n in moved}
    corrected: list[str] = []
    for _attempt in range(10):
        latest = latest_audit(storage)
        racing: list[TaskName] = []
        for seq in range(since + 1, latest.seq + 1):
            try:
                rec = records.decode(storage.read(_segment_key(seq)), expect=Kind.STATE,
                                     name=_segment_key(seq))
            except (CorruptRecord, NotFound):
                continue
            racing += [wanted.pop(s) for s in rec.meta.get("compacted", []) if s in wanted]
        if not racing:
            return corrected
        counts = Counter(latest.counts)
        counts.subtract(n.producer or "unknown" for n in racing)
        body = {"counts": {k: v for k, v in counts.items() if v > 0},
                "compacted": latest.compacted, "drops": [], "merged": False,
                "requeued": [str(n) for n in racing], "at": time.time()}
        try:
            storage.publish(_segment_key(latest.seq + 1), records.encode(Kind.STATE, body))
        except AlreadyExists:  # another compaction first: look again
            for n in racing:
                wanted[str(n)] = n
            continue
        since = latest.seq + 1
        corrected += [n.id for n in racing]
        log.warning("the drop compaction folded %d tasks into the audit while they were "
                    "requeued; audit segment %s takes them out of its counts", len(racing),
                    _segment_key(since))
    return corrected
