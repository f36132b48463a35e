"""The dataset cursor's log on disk: its records read, committed by compare-and-swap, repaired,
garbage-collected, and the release directories they name promoted or discarded.

The feeder (``strawq.data.feeder``) decides what a release is; this is the bookkeeping that makes
it durable. Commit point: ``staging/c-<seq>.<nonce>/`` (one record) renamed to
``cursor/<seq>`` without replacing, so exactly one writer wins each number. A committed
cursor names its release's staging directory, which ``promote`` renames to
``pending/r-<seq>``; staging at or below the newest committed number belongs to a writer that
lost or died, and is discarded (``discard_abandoned``). The key family itself (names, record
checks) is ``strawq.data.cursor``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from strawq.data.binding import (
    DatasetCursorReader,
    DatasetMismatch,
    fingerprints_match,
    growth_problem,
    mismatch_message,
)
from strawq.data.cursor import (
    CURSOR_DIR,
    CURSOR_DIRS,
    KEEP_CURSORS,
    PREPARED,
    Cursor,
    check_cursor_meta,
    cursor_key,
    cursor_name,
    cursor_of,
    int_list,
    list_cursors,
)
from strawq.data.planner import Passes
from strawq.errors import AlreadyExists, CorruptRecord, NotFound, StorageError
from strawq.ondisk.names import CHUNK_PREFIX
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.states import RELEASES, release_dir

log = logging.getLogger(__name__)

#: how often a writer that keeps losing the cursor commit re-reads before giving up
MAX_COMMIT_TRIES = 50


class CursorContention(AlreadyExists):
    """Another writer kept winning the cursor commit; nothing was released by this one."""


class CursorLog:
    """The cursor records of one run, read and written for one dataset reader (whose
    fingerprint every commit records). ``quarantine``: how a damaged record is set aside
    once a readable one replaces it (``RunQueue.quarantine``)."""

    def __init__(self, storage: Storage, reader: DatasetCursorReader, source_count: int,
                 quarantine: Callable[[str], object]) -> None:
        self.storage = storage
        self.reader = reader
        self.source_count = source_count
        self.quarantine = quarantine
        #: the cursor this log last read (``refresh``)
        self.current = Cursor(0, 0, None, False, {})

    def passes(self, cur: Cursor) -> Passes:
        """The passes over the dataset ``cur`` records (``strawq.data.planner``)."""
        return Passes.of(cur.epoch_bases, cur.epoch_offsets, self.reader.base,
                         self.source_count)

    # -- reading -----------------------------------------------------------------------------
    def read(self) -> Cursor:
        """The latest committed cursor (a fresh run starts at index 0)."""
        cursors = list_cursors(self.storage, newest_only=True)
        if not cursors:
            return Cursor(0, 0, None, False, {})
        seq, nxt, name = cursors[-1]
        key = cursor_key(name)
        try:
            rec = records.decode(self.storage.read(key), expect=Kind.CURSOR, name=key)
            check_cursor_meta(rec.meta, key)
        except (CorruptRecord, NotFound) as exc:
            # Publication is atomic, so this is real corruption, not a torn write. The name
            # still says how far the release went; its staging directory is the one whose
            # name starts with r-<seq>. (recover repairs the cursor).
            log.error("cursor record %s is corrupt (%s); continuing from index %d as its name "
                      "says", key, exc, nxt)
            staging = next((s for s in self.storage.list("staging")
                            if RELEASES.parse(s) == seq), None)
            return Cursor(seq, nxt, staging, False, {}, corrupt=key)
        return cursor_of(rec.meta)

    def refresh(self) -> Cursor:
        """Re-read the newest cursor and finish its release (promote, repair a bad record)."""
        for _ in range(MAX_COMMIT_TRIES):
            cur = self.read()
            if not cur.corrupt:
                self.promote(cur)
                self.current = cur
                return cur
            self.promote(cur)
            if self._commit_repair(cur):
                self.quarantine(cur.corrupt)
        raise CursorContention(17, "the cursor kept changing while this feeder repaired it")

    def _last_intact(self, seq: int) -> Cursor | None:
        """The newest readable cursor record older than ``seq`` (``KEEP_CURSORS`` are kept)."""
        for old, _nxt, name in reversed(list_cursors(self.storage)):
            if old >= seq:
                continue
            key = cursor_key(name)
            try:
                rec = records.decode(self.storage.read(key), expect=Kind.CURSOR, name=key)
                check_cursor_meta(rec.meta, key)
            except (CorruptRecord, NotFound):
                continue
            return cursor_of(rec.meta)
        return None

    def _commit_repair(self, cur: Cursor) -> bool:
        """Commit a readable cursor in place of the damaged ``cur``: at the index its name
        gives, with the dataset, the passes and (at the same index) the exhaustion of the
        newest intact record before it. A release moves the index but keeps the dataset and
        the passes, so those are what the damaged record held, unless it opened a pass or
        switched datasets at an unchanged index: then the intact record's state is taken
        whole, and the pass is opened again (nothing was released under it yet)."""
        prev = self._last_intact(cur.seq)
        fp = self.reader.fingerprint
        exhausted = False
        extra: dict[str, Any] = {}
        if prev is not None:
            fp = prev.fingerprint or fp
            extra = self.passes(prev).record()
            exhausted = prev.exhausted and prev.next_index == cur.next_index
            self.reader.base = int(fp.get("base", 0) or 0)
        return self.commit(cur.seq + 1, cur.next_index, None, exhausted, repaired=cur.corrupt,
                           fingerprint=fp, **extra)

    # -- rebinding: the run's dataset changes, on purpose ---------------------------------------
    def switch(self, start_row: int) -> Cursor:
        """Commit this reader's dataset as the run's, its row ``start_row`` at the next task
        index (``Feeder.switch_dataset``); the refreshed cursor."""
        if start_row < 0:
            raise ValueError(f"start_row must be >= 0, got {start_row}")
        for _ in range(MAX_COMMIT_TRIES):
            cur = self.refresh()
            self.reader.base = cur.next_index - start_row
            if self.commit(cur.seq + 1, cur.next_index, None, False,
                           switched_from=cur.fingerprint, start_row=start_row):
                log.warning("switched the run's dataset to %s at task index %d (row %d)",
                            self.reader.dataset.url, cur.next_index, start_row)
                return self.refresh()
        raise CursorContention(17, "the cursor kept changing while switching datasets")

    def grow(self) -> Cursor:
        """Commit this reader's dataset as the run's when it is the run's with rows appended
        (``Feeder.continue_grown``); the refreshed cursor."""
        dataset = self.reader.dataset
        for _ in range(MAX_COMMIT_TRIES):
            cur = self.refresh()
            if fingerprints_match(cur.fingerprint, dataset.fingerprint):
                self.reader.adopt(cur.fingerprint, cur.next_index)
                return cur
            problem = growth_problem(cur.fingerprint, dataset)
            if problem is not None:
                raise DatasetMismatch(mismatch_message(cur.fingerprint, dataset,
                                                       cur.next_index))
            self.reader.base = int(cur.fingerprint.get("base", 0) or 0)
            extra: dict[str, Any] = ({"epoch_bases": list(cur.epoch_bases)}
                                     if cur.epoch_bases else {})
            if self.commit(cur.seq + 1, cur.next_index, None, False,
                           grew_from=cur.fingerprint, recent=list(cur.recent), **extra):
                log.warning("the run's dataset grew: continuing over %s from task index %d "
                            "(the cursor records its new fingerprint)", dataset.url,
                            cur.next_index)
                return self.refresh()
        raise CursorContention(17, "the cursor kept changing while continuing a grown dataset")

    def checkpoint_rows(self, state: dict[str, Any]) -> tuple[Passes, list[int]]:
        """A trainer checkpoint's feeder state read (``Feeder.load_state_dict``): its passes
        and the task indexes it lists in flight that are released again (those of this
        dataset's passes; a dataset before a switch is named and left)."""
        nxt = int(state["next_index"])
        bases, offsets = state.get("epoch_bases") or [], state.get("epoch_offsets") or []
        if not int_list(bases) or not isinstance(offsets, list) \
                or not all(int_list(o) for o in offsets):
            raise ValueError(f"checkpoint feeder state: epoch_bases must be a list of task "
                             f"indexes and epoch_offsets a list of lists of rows, got "
                             f"{bases!r} and {offsets!r}")
        passes = Passes.of(bases, offsets, self.reader.base, self.source_count)
        again = sorted({int(i) for i in state.get("in_flight") or () if int(i) < nxt})
        # In flight from any pass over this dataset is released again, each row read in its
        # own pass; only the prompts of a dataset before a switch are not.
        before = [i for i in again if i < passes.bases[0]]
        if before:
            log.warning("%d prompts in flight at the checkpoint come from the dataset before "
                        "the switch (indexes %d..%d): they are not released again",
                        len(before), before[0], before[-1])
            again = [i for i in again if i >= passes.bases[0]]
        return passes, again

    # -- writing -----------------------------------------------------------------------------
    def commit(self, seq: int, next_index: int, staging: str | None, exhausted: bool,
               **extra: Any) -> bool:
        """Compare-and-swap the cursor to ``seq``: False if another writer took ``seq``.

        The record is written into ``staging/c-<seq>.<nonce>/`` and the directory renamed
        to ``cursor/<seq>`` without replacing: exactly one writer wins each number.
        """
        meta = {"seq": seq, "next_index": next_index, "staging": staging,
                "exhausted": exhausted, "fingerprint": self.reader.fingerprint,
                "at": time.time(), **extra}
        prep = f"staging/{PREPARED.name(seq, uuid.uuid4().hex[:8])}"
        try:
            self.storage.publish(f"{prep}/{cursor_name(seq, next_index)}",
                                 records.encode(Kind.CURSOR, meta), in_place=True)
            self.storage.rename(prep, cursor_key(CURSOR_DIRS.name(seq)))
        except (AlreadyExists, NotFound):
            # NotFound: a recovering writer discarded our preparation (its number is taken)
            self.discard(prep.partition("/")[2])
            return False
        return True

    def gc(self, seq: int) -> None:
        """Delete the cursor records ``KEEP_CURSORS`` or more below ``seq``."""
        for old, _next, name in list_cursors(self.storage):
            if old <= seq - KEEP_CURSORS:
                self.storage.delete(cursor_key(name))
                if "/" in name:
                    self.storage.rmdir(cursor_key(CURSOR_DIRS.name(old)))
        # emptied by a crash mid-GC, or repaired
        for name in CURSOR_DIRS.below(self.storage.list(CURSOR_DIR), seq - KEEP_CURSORS + 1):
            self.storage.rmdir(cursor_key(name))

    # -- release directories -----------------------------------------------------------------
    def promote(self, cur: Cursor) -> None:
        """Move the release ``cur`` committed from ``staging/`` to pending (once)."""
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

    def discard_abandoned(self, seq: int, keep: str | None = None,
                          level: int = logging.WARNING) -> None:
        """Delete staging at or below the committed number ``seq`` (its writer lost or died);
        staging for a higher number may be another writer's release in progress: kept."""
        for name in self.storage.list("staging"):
            number = RELEASES.parse(name)
            number = PREPARED.parse(name) if number is None else number
            if name == keep or (number is not None and number > seq):
                continue
            log.log(level, "discarding uncommitted release staging/%s", name)
            self.discard(name)

    def discard_quietly(self, staging: str) -> None:
        """``discard``, a failure logged (``strawq gc`` removes what is left)."""
        try:
            self.discard(staging)
        except StorageError as exc:
            log.warning("could not delete the refused release's staging/%s (%s); strawq gc "
                        "removes it", staging, exc)

    def discard(self, staging: str) -> None:
        """Delete ``staging/<staging>/`` and what is in it (its chunk directories too)."""
        for f in self.storage.list(f"staging/{staging}"):
            if f.startswith(CHUNK_PREFIX) and self.storage.is_dir(f"staging/{staging}/{f}"):
                for g in self.storage.list(f"staging/{staging}/{f}"):
                    self.storage.delete(f"staging/{staging}/{f}/{g}")
                self.storage.rmdir(f"staging/{staging}/{f}")
                continue
            self.storage.delete(f"staging/{staging}/{f}")
        self.storage.rmdir(f"staging/{staging}")
