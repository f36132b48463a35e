"""The dataset cursor and the release of prompt tasks (the feeder).

A release of rows ``[start, end)`` is made idempotent by preparing it out of sight and
committing it with one exclusive create:

1. write every task record into ``staging/r-<seq>.<nonce>/`` (fsync'd, not yet visible);
   malformed rows are recorded in ``dropped/`` (exclusive create, so a redo is a no-op);
2. publish ``cursor/<seq>`` naming ``end`` and the staging directory — the commit point;
3. rename the staging directory to ``pending/r-<seq>`` — one atomic move of all its tasks.

A crash before 2 leaves an uncommitted staging directory: ``recover`` deletes it and the
next release redoes the range. A crash between 2 and 3 leaves a committed one: ``recover``
finishes step 3. No index is ever released twice, and none is skipped.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from strawq import records
from strawq.dataset import BadRow, Dataset, DatasetCursorReader
from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.names import STAGE_FRESH, TaskName, dataset_task_id, note_key, queue_key
from strawq.queue import RunQueue
from strawq.records import Kind
from strawq.states import DIRS, RELEASE_PREFIX, TaskState, key_of, release_dir
from strawq.storage import Storage

log = logging.getLogger(__name__)

KEEP_CURSORS = 4


@dataclass(frozen=True)
class Cursor:
    seq: int
    next_index: int
    staging: str | None
    exhausted: bool
    fingerprint: dict[str, Any]
    #: key of a cursor record that failed its checks (recover() repairs it)
    corrupt: str | None = None


def cursor_name(seq: int, next_index: int) -> str:
    """``<seq>.<next_index>``: the name alone says where the cursor stands, so a cursor
    record whose content is damaged still tells how far the dataset was released."""
    return f"{seq:012d}.{next_index:012d}"


def list_cursors(storage: Storage) -> list[tuple[int, int, str]]:
    """(seq, next_index, name) of every cursor record, oldest first."""
    out = []
    for name in storage.list("cursor"):
        seq, dot, nxt = name.partition(".")
        if dot and seq.isdigit() and nxt.isdigit():
            out.append((int(seq), int(nxt), name))
    return sorted(out)


def read_cursor_state(storage: Storage) -> dict[str, Any] | None:
    """The newest cursor as ``Feeder.state_dict()``, read-only (no recovery side effects)."""
    cursors = list_cursors(storage)
    if not cursors:
        return None
    seq, nxt, name = cursors[-1]
    state: dict[str, Any] = {"seq": seq, "next_index": nxt, "fingerprint": {}, "exhausted": False}
    try:
        rec = records.decode(storage.read(f"cursor/{name}"), expect=Kind.CURSOR,
                             name=f"cursor/{name}")
        state["fingerprint"] = rec.meta.get("fingerprint", {})
        state["exhausted"] = bool(rec.meta.get("exhausted", False))
    except (CorruptRecord, NotFound) as exc:
        state["error"] = str(exc)
    return state


class Feeder:
    """Releases prompt tasks from a dataset. Exactly one feeder per run (the collector)."""

    def __init__(self, queue: RunQueue, dataset: Dataset) -> None:
        self.queue = queue
        self.storage = queue.storage
        self.dataset = dataset
        self._reader = DatasetCursorReader(dataset)
        self.cursor = self.recover()

    # -- cursor ------------------------------------------------------------------------------
    def read_cursor(self) -> Cursor:
        """The latest committed cursor (a fresh run starts at index 0)."""
        cursors = list_cursors(self.storage)
        if not cursors:
            return Cursor(0, 0, None, False, {})
        seq, nxt, name = cursors[-1]
        key = f"cursor/{name}"
        try:
            rec = records.decode(self.storage.read(key), expect=Kind.CURSOR, name=key)
        except CorruptRecord as exc:
            # Publication is atomic, so this is real corruption, not a torn write. The name
            # still says how far the release went; its staging directory is the one whose
            # name starts with r-<seq>. (recover repairs the cursor).
            log.error("cursor record %s is corrupt (%s); continuing from index %d as its name "
                      "says", key, exc, nxt)
            prefix = f"{RELEASE_PREFIX}{seq:012d}."
            staging = next((s for s in self.storage.list("staging") if s.startswith(prefix)),
                           None)
            return Cursor(seq, nxt, staging, False, {}, corrupt=key)
        m = rec.meta
        return Cursor(m["seq"], m["next_index"], m.get("staging"), m.get("exhausted", False),
                      m.get("fingerprint", {}))

    def recover(self) -> Cursor:
        """Finish a committed release and delete uncommitted ones. Reads O(in flight)."""
        cur = self.read_cursor()
        if cur.corrupt:
            self._promote(cur)
            self._write_cursor(cur.seq + 1, cur.next_index, None, False, repaired=cur.corrupt)
            self.queue.quarantine(cur.corrupt)
            cur = self.read_cursor()
        for name in self.storage.list("staging"):
            if cur.staging == name:
                self._promote(cur)
            else:
                log.warning("discarding uncommitted release staging/%s", name)
                for f in self.storage.list(f"staging/{name}"):
                    self.storage.delete(f"staging/{name}/{f}")
                self.storage.rmdir(f"staging/{name}")
        if cur.fingerprint and cur.fingerprint != self.dataset.fingerprint:
            log.warning("the dataset changed since the cursor was written (%s, now %s); "
                        "continuing from index %d", cur.fingerprint, self.dataset.fingerprint,
                        cur.next_index)
        return cur

    def _promote(self, cur: Cursor) -> None:
        if cur.staging is None:
            return
        try:
            # dataset -> PENDING: a whole release at once, one directory rename
            self.storage.rename(f"staging/{cur.staging}", release_dir(cur.seq))
        except NotFound:
            pass  # already promoted
        except AlreadyExists:
            log.error("%s exists while staging/%s is still there; leaving both for "
                      "inspection", release_dir(cur.seq), cur.staging)

    # -- release -----------------------------------------------------------------------------
    def release(self, n: int | None = None) -> int:
        """Release up to ``n`` more prompts (``release_batch`` by default); returns count."""
        n = self.queue.config.release_batch if n is None else n
        cur = self.cursor
        if n <= 0 or cur.exhausted:
            return 0
        rows = self._reader.read(cur.next_index, n)
        seq = cur.seq + 1
        staging = f"{RELEASE_PREFIX}{seq:012d}.{uuid.uuid4().hex[:8]}"
        good = 0
        for index, row in rows:
            task_id = dataset_task_id(index)
            if isinstance(row, BadRow):
                self._record_bad_row(task_id, row)
                continue
            name = TaskName(key=queue_key(STAGE_FRESH, 0, index), id=task_id, gen=0,
                            attempts=0, resume=-1)
            body = {"task": {"index": index, "id": task_id, "row": row}}
            self.storage.publish(f"staging/{staging}/{name}", records.encode(Kind.TASK, body),
                                 sync_dir=False)
            good += 1
        # The staging directory exists only once a good row was staged in it.
        self.storage.sync_dirs([f"staging/{staging}"] * bool(good)
                               + ["staging", DIRS[TaskState.DROPPED]])
        end = rows[-1][0] + 1 if rows else cur.next_index
        exhausted = len(rows) < n
        new = Cursor(seq, end, staging if good else None, exhausted, self.dataset.fingerprint)
        self._write_cursor(seq, end, new.staging, exhausted)
        if good:
            self._promote(new)
        else:
            self.storage.rmdir(f"staging/{staging}")
        self.cursor = new
        self._gc_cursors(seq)
        return len(rows)

    def _write_cursor(self, seq: int, next_index: int, staging: str | None, exhausted: bool,
                      **extra: Any) -> None:
        meta = {"seq": seq, "next_index": next_index, "staging": staging,
                "exhausted": exhausted, "fingerprint": self.dataset.fingerprint,
                "at": time.time(), **extra}
        self.storage.publish(f"cursor/{cursor_name(seq, next_index)}",
                             records.encode(Kind.CURSOR, meta))

    def _record_bad_row(self, task_id: str, row: BadRow) -> None:
        name = TaskName(key=queue_key(STAGE_FRESH, 0, row.index), id=task_id, gen=0,
                        attempts=0, resume=-1, producer="bad_row")
        body = {"task_id": task_id, "gen": 0, "attempts": 0, "reason": "bad_row",
                "message": row.message, "at": time.time(), "summary": {"index": row.index}}
        log.error("dropping dataset row %d: %s", row.index, row.message)
        # dataset -> DROPPED: the note, then the entry, each by exclusive create
        for key, kind in ((note_key(task_id, 0, "drop", "bad_row"), Kind.DROP),
                          (key_of(TaskState.DROPPED, name), Kind.DROP)):
            try:
                self.storage.publish(key, records.encode(kind, body), sync_dir=False)
            except AlreadyExists:
                pass

    def _gc_cursors(self, seq: int) -> None:
        for old, _next, name in list_cursors(self.storage):
            if old <= seq - KEEP_CURSORS:
                self.storage.delete(f"cursor/{name}")

    @property
    def exhausted(self) -> bool:
        return self.cursor.exhausted

    def state_dict(self) -> dict[str, Any]:
        """The cursor for a trainer checkpoint (resume when the queue state is gone)."""
        return {"next_index": self.cursor.next_index, "seq": self.cursor.seq,
                "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start releasing at a checkpointed index (only on an empty, fresh queue)."""
        if self.cursor.seq:
            raise AlreadyExists(17, f"the queue already has a cursor at index "
                                    f"{self.cursor.next_index}; it wins over a checkpoint")
        self._write_cursor(1, int(state["next_index"]), None, False,
                           restored_from_checkpoint=True)
        self.cursor = self.read_cursor()
