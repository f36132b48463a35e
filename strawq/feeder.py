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
from strawq.names import STAGE_FRESH, TaskName, data_key, dataset_task_id, queue_key
from strawq.queue import RunQueue
from strawq.records import Kind

log = logging.getLogger(__name__)

KEEP_CURSORS = 4


@dataclass(frozen=True)
class Cursor:
    seq: int
    next_index: int
    staging: str | None
    exhausted: bool
    fingerprint: dict[str, Any]


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
        for name in reversed(self.storage.list("cursor")):
            if not name.isdigit():
                continue
            key = f"cursor/{name}"
            try:
                rec = records.decode(self.storage.read(key), expect=Kind.CURSOR, name=key)
            except CorruptRecord as exc:
                # Only the newest can be torn by a crash, and it was never committed: the
                # exclusive create publishes whole files. Anything else is real corruption.
                log.error("cursor record %s is corrupt (%s); quarantining it", key, exc)
                self.queue.quarantine(key)
                continue
            m = rec.meta
            return Cursor(m["seq"], m["next_index"], m.get("staging"), m.get("exhausted", False),
                          m.get("fingerprint", {}))
        return Cursor(0, 0, None, False, {})

    def recover(self) -> Cursor:
        """Finish a committed release and delete uncommitted ones. Reads O(in flight)."""
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
            self.storage.rename(f"staging/{cur.staging}", f"pending/r-{cur.seq:012d}")
        except NotFound:
            pass  # already promoted
        except AlreadyExists:
            log.error("pending/r-%012d exists while staging/%s is still there; leaving both "
                      "for inspection", cur.seq, cur.staging)

    # -- release -----------------------------------------------------------------------------
    def release(self, n: int | None = None) -> int:
        """Release up to ``n`` more prompts (``release_batch`` by default); returns count."""
        n = self.queue.config.release_batch if n is None else n
        cur = self.cursor
        if n <= 0 or cur.exhausted:
            return 0
        rows = self._reader.read(cur.next_index, n)
        seq = cur.seq + 1
        staging = f"r-{seq:012d}.{uuid.uuid4().hex[:8]}"
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
        self.storage.sync_dirs([f"staging/{staging}"] * bool(good) + ["staging", "dropped"])
        end = rows[-1][0] + 1 if rows else cur.next_index
        exhausted = len(rows) < n
        new = Cursor(seq, end, staging if good else None, exhausted, self.dataset.fingerprint)
        meta = {"seq": seq, "next_index": end, "staging": new.staging, "exhausted": exhausted,
                "fingerprint": new.fingerprint, "at": time.time()}
        self.storage.publish(f"cursor/{seq:012d}", records.encode(Kind.CURSOR, meta))
        if good:
            self._promote(new)
        else:
            self.storage.rmdir(f"staging/{staging}")
        self.cursor = new
        self._gc_cursors(seq)
        return len(rows)

    def _record_bad_row(self, task_id: str, row: BadRow) -> None:
        name = TaskName(key=queue_key("c", 0, row.index), id=task_id, gen=0, attempts=0,
                        resume=-1, producer="bad_row")
        body = {"task_id": task_id, "gen": 0, "attempts": 0, "reason": "bad_row",
                "message": row.message, "at": time.time(), "summary": {"index": row.index}}
        log.error("dropping dataset row %d: %s", row.index, row.message)
        for key, kind in ((data_key(task_id, 0, "drop"), Kind.DROP),
                          (f"dropped/{name}", Kind.DROP)):
            try:
                self.storage.publish(key, records.encode(kind, body), sync_dir=False)
            except AlreadyExists:
                pass

    def _gc_cursors(self, seq: int) -> None:
        for name in self.storage.list("cursor"):
            if name.isdigit() and int(name) <= seq - KEEP_CURSORS:
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
        meta = {"seq": 1, "next_index": int(state["next_index"]), "staging": None,
                "exhausted": False, "fingerprint": self.dataset.fingerprint, "at": time.time(),
                "restored_from_checkpoint": True}
        self.storage.publish(f"cursor/{1:012d}", records.encode(Kind.CURSOR, meta))
        self.cursor = self.read_cursor()
