"""The dataset cursor and the release of prompt tasks (the feeder).

A release of rows ``[start, end)`` is made idempotent by preparing it out of sight and
committing it with one exclusive create:

0. judge the rows' bad share (``strawq.release_check.judge_release``, ``max_bad_row_share``): a
   release that would drop too many is refused before anything is written (``BadRowsRefused``:
   the cursor does not move);
1. write every task record into ``staging/r-<seq>.<nonce>/`` (fsync'd, not yet visible);
   malformed rows are recorded in ``dropped/`` (exclusive create, so a redo is a no-op);
2. publish ``cursor/<seq>`` naming ``end`` and the staging directory — the commit point;
3. rename the staging directory to ``pending/r-<seq>`` — one atomic move of all its tasks.

A crash before 2 leaves an uncommitted staging directory: ``recover`` deletes it and the
next release redoes the range. A crash between 2 and 3 leaves a committed one: ``recover``
finishes step 3. No index is ever released twice, and none is skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from strawq import records
from strawq.cursor import (CURSOR_DIR, CURSOR_DIRS, KEEP_CURSORS, PREPARED, Cursor,
                           check_cursor_meta, cursor_key, cursor_name, cursor_of, int_list,
                           list_cursors, newest_seq, read_cursor_state)
from strawq.dataset import BadRow, Dataset, Row
from strawq.binding import (DatasetMismatch, fingerprints_match, growth_problem,
                            mismatch_message, require_rows)
from strawq.release_check import (BadRowsRefused, ReleasePreview, judge_release, preview,
                                  refusal_message)
from strawq.errors import AlreadyExists, ConfigError, CorruptRecord, NotFound, StorageError
from strawq.history import record_attempts
from strawq.names import STAGE_FRESH, TaskName, dataset_task_id, note_key, queue_key
from strawq.planner import Passes, ReleasePlanner, Rows
from strawq.prompt_policy import Plan, skip_rows
from strawq.queue import RunQueue
from strawq.records import Kind
from strawq.states import DIRS, RELEASES, TaskState, key_of, release_dir

log = logging.getLogger(__name__)

#: how often a writer that keeps losing the cursor commit re-reads before giving up
MAX_COMMIT_TRIES = 50
#: rows staged between two calls of ``Feeder.on_progress``
PROGRESS_EVERY = 500


class CursorContention(AlreadyExists):
    """Another writer kept winning the cursor commit; nothing was released by this one."""


def check_share(share: float) -> float:
    """``share`` if it is a valid ``max_bad_row_share`` (0..1), else ``ConfigError``."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ConfigError(f"max_bad_row_share must be a number from 0 to 1 (a share of the rows "
                          f"released), got {share!r}")
    return float(share)


class Feeder:
    """Releases prompt tasks from a dataset.

    Any number of feeders may run against one run (the collector's, an operator's
    ``strawq release``, a stalled collector after a takeover): each release re-reads the
    newest cursor from disk and commits with a compare-and-swap on the sequence number
    (exclusive rename of ``cursor/<seq>``). A writer that loses — another commit took the
    number, or a newer cursor exists — discards its staging and re-reads, so it never
    releases on stale knowledge (docs/design.md, invariant 8).
    """

    def __init__(self, queue: RunQueue, dataset: Dataset, *, check_dataset: bool = True,
                 max_bad_row_share: float | None = None) -> None:
        """``DatasetMismatch`` if ``dataset`` is not the one the run's cursor counts over, or
        its prompt key is not the run's (``check_dataset=False``: only to switch_dataset or
        continue_grown); ``EmptyDataset`` if it holds no row (checked before anything is
        written). ``max_bad_row_share``: this feeder's bound on the bad rows a release may
        drop (the run's ``QueueConfig.max_bad_row_share`` by default)."""
        self.max_bad_row_share = check_share(queue.config.max_bad_row_share
                                             if max_bad_row_share is None
                                             else max_bad_row_share)
        if dataset.prompt_key != queue.config.prompt_key:
            raise DatasetMismatch(f"the dataset is read with prompt_key "
                                  f"{dataset.prompt_key!r} but the run's prompt_key is "
                                  f"{queue.config.prompt_key!r}; the run's key wins: read the "
                                  f"dataset with prompt_key={queue.config.prompt_key!r}")
        require_rows(dataset)  # an empty dataset never binds the run (EmptyDataset)
        self.queue = queue
        self.storage = queue.storage
        self.dataset = dataset
        #: the decisions of every release (``strawq.planner``); this class makes them durable
        self.planner = ReleasePlanner(dataset, queue.config, queue.storage)
        self._reader = self.planner.reader
        #: called as ``on_progress(staged, rows)`` every ``PROGRESS_EVERY`` rows a release
        #: stages (``strawq release`` shows it: a long release is not silent); None: quiet
        self.on_progress: Callable[[int, int], None] | None = None
        #: rows this feeder's releases skipped by the history's rule (``prompt_policy``)
        self.skipped_total = 0
        self._skipped: list[str] = []
        self.cursor = self.recover()
        if check_dataset:
            self._reader.adopt(self.cursor.fingerprint, self.cursor.next_index)

    # -- cursor ------------------------------------------------------------------------------
    def read_cursor(self) -> Cursor:
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
            cur = self.read_cursor()
            if not cur.corrupt:
                self._promote(cur)
                self.cursor = cur
                return cur
            self._promote(cur)
            if self._commit_repair(cur):
                self.queue.quarantine(cur.corrupt)
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
        fp = self._reader.fingerprint
        exhausted = False
        extra: dict[str, Any] = {}
        if prev is not None:
            fp = prev.fingerprint or fp
            extra = self.passes(prev).record()
            exhausted = prev.exhausted and prev.next_index == cur.next_index
            self._reader.base = int(fp.get("base", 0) or 0)
        return self._commit(cur.seq + 1, cur.next_index, None, exhausted, repaired=cur.corrupt,
                            fingerprint=fp, **extra)

    def recover(self) -> Cursor:
        """Finish a committed release and delete abandoned staging. Reads O(in flight).

        Safe beside live writers: only staging at or below the newest committed sequence
        number is abandoned (a writer still preparing it will lose its commit); staging for
        a higher number may belong to a writer in the middle of a release and is left alone.
        """
        cur = self.refresh()
        self._discard_abandoned(cur.seq, keep=cur.staging)
        if not fingerprints_match(cur.fingerprint, self.dataset.fingerprint):
            # Nothing is released from it: a release re-checks the fingerprint, and refuses
            # until the run is switched to it or continues it as grown.
            log.debug("%s is not the dataset the cursor at index %d counts over",
                      self.dataset.url, cur.next_index)
        return cur

    def _discard_abandoned(self, seq: int, keep: str | None = None,
                           level: int = logging.WARNING) -> None:
        """Delete staging at or below the committed number ``seq`` (its writer lost or died);
        staging for a higher number may be another writer's release in progress: kept."""
        for name in self.storage.list("staging"):
            number = RELEASES.parse(name)
            number = PREPARED.parse(name) if number is None else number
            if name == keep or (number is not None and number > seq):
                continue
            log.log(level, "discarding uncommitted release staging/%s", name)
            self._discard(name)

    def _discard_quietly(self, staging: str) -> None:
        try:
            self._discard(staging)
        except StorageError as exc:
            log.warning("could not delete the refused release's staging/%s (%s); strawq gc "
                        "removes it", staging, exc)

    def _discard(self, staging: str) -> None:
        for f in self.storage.list(f"staging/{staging}"):
            self.storage.delete(f"staging/{staging}/{f}")
        self.storage.rmdir(f"staging/{staging}")

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
        """Release up to ``n`` more prompts (``release_batch`` by default); returns count.

        The newest cursor is re-read first, so a release by another writer (an operator's
        ``strawq release``) is seen, never repeated. ``CursorContention`` if other writers
        won the commit ``MAX_COMMIT_TRIES`` times in a row. ``BadRowsRefused`` if it would
        drop more bad rows than ``max_bad_row_share`` allows: nothing is written and the
        cursor stays where it was.
        """
        n = self.queue.config.release_batch if n is None else n
        released = lost = 0
        while lost < MAX_COMMIT_TRIES:
            cur = self.refresh()
            self._reader.adopt(cur.fingerprint, cur.next_index)  # never the wrong dataset
            if n - released <= 0:
                return released
            if cur.exhausted:
                if not self._epochs_left(cur):
                    return released
                if not self._next_epoch(cur):
                    lost += 1
                continue
            got = self._release_after(cur, n - released)
            if got is None:
                lost += 1
                continue
            rows, skipped = got
            released += rows - skipped
            if rows and not skipped:
                return released
            # Rows the history skipped were not released: take as many more (a pass whose
            # groups all agreed would otherwise release nothing). No rows: the pass ended
            # exactly here, and the next may begin.
        raise CursorContention(17, f"lost the cursor commit {MAX_COMMIT_TRIES} times in a row; "
                                   "other writers keep releasing: retry later")

    def passes(self, cur: Cursor) -> Passes:
        """The passes over the dataset ``cur`` records (``strawq.planner``)."""
        return Passes.of(cur.epoch_bases, cur.epoch_offsets, self._reader.base,
                         self.dataset.source_count)

    def _epochs_left(self, cur: Cursor) -> bool:
        return cur.epoch + 1 < self.queue.config.num_epochs

    def _next_epoch(self, cur: Cursor) -> bool:
        """Start the next pass over the dataset at the next task index (new task ids, as
        ``switch_dataset`` to the same data), each mixture source where the pass before left
        it (``ReleasePlanner.next_pass``). False if the commit was lost."""
        nxt = self.planner.next_pass(self.passes(cur), cur.next_index)
        if nxt is None:
            return False
        self._reader.base = cur.next_index
        won = self._commit(cur.seq + 1, cur.next_index, None, False, **nxt.record())
        if won:
            log.info("pass %d of %d over %s starts at task index %d%s", nxt.number + 1,
                     self.queue.config.num_epochs, self.dataset.url, cur.next_index,
                     f" (sources at rows {list(nxt.offsets[-1])})" if any(nxt.offsets[-1])
                     else "")
        return won

    def _release_after(self, cur: Cursor, n: int) -> tuple[int, int] | None:
        """One release after ``cur``: (rows consumed, rows the history skipped); None when
        another writer won the commit."""
        passes = self.passes(cur)
        rows = self.planner.read(passes, cur.next_index, n)
        recent = self._judge(cur, rows)
        seq = cur.seq + 1
        staging = RELEASES.name(seq, uuid.uuid4().hex[:8])
        plan = self.planner.plan(passes, rows)
        if plan.skips:
            # Before the commit: a crash after it would otherwise leave skips unrecorded (a
            # redo re-records the same rows, counted once: they are keyed by task id).
            record_attempts(self.storage, skip_rows(plan.skips))
        try:
            got = self._stage_and_commit(cur, rows, n, seq, staging, recent, plan)
        except NotFound:
            # A writer that committed ``seq`` first discarded our staging under us.
            log.info("release %d lost its staging to a writer that committed first; "
                     "re-reading the cursor", seq)
            self._discard(staging)
            return None
        if got is None:
            return None
        self.skipped_total += len(plan.skips)
        self._skipped += [dataset_task_id(s.index) for s in plan.skips]
        return got, len(plan.skips)

    def take_skipped(self) -> list[str]:
        """The task ids this feeder's releases skipped (the history's rule) since the last
        call, oldest first."""
        out, self._skipped = self._skipped, []
        return out

    def _judge(self, cur: Cursor, rows: list[tuple[int, Row | BadRow]]) -> tuple[int, int]:
        """The bad-row window after releasing ``rows``; ``BadRowsRefused`` (nothing written
        yet) when they hold more bad rows than ``max_bad_row_share`` allows."""
        bad = [r for _, r in rows if isinstance(r, BadRow)]
        why, recent = judge_release(len(rows), bad, max_share=self.max_bad_row_share,
                                    window=self.queue.config.release_batch, recent=cur.recent,
                                    first=cur.next_index == self._reader.base)
        if why is not None:
            end = rows[-1][0] + 1
            raise BadRowsRefused(refusal_message(why, bad, cur.next_index, end,
                                                 self.dataset.prompt_key),
                                 bad, len(rows), cur.next_index)
        return recent

    def _stage(self, rows: Rows, staging: str, passes: Passes, plan: Plan | None = None
               ) -> int:
        """Write ``rows`` as fresh tasks into ``staging/<staging>/`` (bad rows are dropped
        with a record); returns how many were staged. ``plan``: stage only its rows, the
        i-th of its order under the release's i-th order number (claims go in key order)."""
        good = 0
        skipped = {s.index for s in plan.skips} if plan else set()
        order = dict(zip(plan.order, sorted(plan.order), strict=True)) if plan else {}
        for done, (index, row) in enumerate(rows):
            if self.on_progress is not None and done % PROGRESS_EVERY == 0:
                self.on_progress(done, len(rows))
            task_id = dataset_task_id(index)
            if isinstance(row, BadRow):
                self._record_bad_row(task_id, row)
                continue
            if index in skipped:
                continue
            name = TaskName(key=queue_key(STAGE_FRESH, 0, order.get(index, index)), id=task_id,
                            gen=0, attempts=0, resume=-1)
            body = {"task": self.planner.task(passes, index, row)}
            # In place: nobody reads a staging directory before its rename to pending/,
            # which comes after every record in it was written, fsync'd and closed (no
            # temporary file and rename per record: docs/protocol.md §5).
            self.storage.publish(f"staging/{staging}/{name}", records.encode(Kind.TASK, body),
                                 sync_dir=False, in_place=True)
            good += 1
        # The staging directory exists only once a good row was staged in it.
        self.storage.sync_dirs([f"staging/{staging}"] * bool(good)
                               + ["staging", DIRS[TaskState.DROPPED]])
        return good

    def _stage_and_commit(self, cur: Cursor, rows: Rows, n: int, seq: int, staging: str,
                          recent: tuple[int, int], plan: Plan) -> int | None:
        passes = self.passes(cur)
        try:
            good = self._stage(rows, staging, passes, plan)
        except StorageError:  # refused (a full disk): what it staged goes, not left behind
            self._discard_quietly(staging)
            raise
        end = rows[-1][0] + 1 if rows else cur.next_index
        exhausted = len(rows) < n
        new = Cursor(seq, end, staging if good else None, exhausted, self._reader.fingerprint,
                     recent=recent, epoch_bases=cur.epoch_bases,
                     epoch_offsets=cur.epoch_offsets)
        extra = passes.record()
        if exhausted and not self._epochs_left(cur):
            unread = self.planner.unread(passes, end)
            if unread:  # the stopping strategy ended the run before these rows
                extra["unread"] = unread
                log.warning("the last pass over %s ended before these rows of its sources "
                            "(stopping_strategy): %s", self.dataset.url,
                            ", ".join(f"{k} rows {a}..{b - 1}" for k, (a, b) in unread.items()))
        if plan.skips:
            extra["skipped_zero_variance"] = len(plan.skips)
        won = self._commit(seq, end, new.staging, exhausted, start=cur.next_index,
                           recent=list(recent), **extra)
        if won and newest_seq(self.storage) > seq and (
                not good or self.storage.exists(f"staging/{staging}")):
            # We took a number whose record had been garbage-collected: a newer cursor
            # exists, our knowledge was stale. Our record is older than the newest and
            # never read; the staging is discarded.
            won = False
        if not won:
            log.info("release %d (rows %d..%d) lost the cursor commit to another writer; "
                     "re-reading the cursor", seq, cur.next_index, end)
            self._discard(staging)
            return None
        if good:
            self._promote(new)
        else:
            self.storage.rmdir(f"staging/{staging}")
        self.cursor = new
        self._gc_cursors(seq)
        self._discard_abandoned(seq, level=logging.INFO)
        return len(rows)

    def _commit(self, seq: int, next_index: int, staging: str | None, exhausted: bool,
                **extra: Any) -> bool:
        """Compare-and-swap the cursor to ``seq``: False if another writer took ``seq``.

        The record is written into ``staging/c-<seq>.<nonce>/`` and the directory renamed
        to ``cursor/<seq>`` without replacing: exactly one writer wins each number.
        """
        meta = {"seq": seq, "next_index": next_index, "staging": staging,
                "exhausted": exhausted, "fingerprint": self._reader.fingerprint,
                "at": time.time(), **extra}
        prep = f"staging/{PREPARED.name(seq, uuid.uuid4().hex[:8])}"
        try:
            self.storage.publish(f"{prep}/{cursor_name(seq, next_index)}",
                                 records.encode(Kind.CURSOR, meta), in_place=True)
            self.storage.rename(prep, cursor_key(CURSOR_DIRS.name(seq)))
        except (AlreadyExists, NotFound):
            # NotFound: a recovering writer discarded our preparation (its number is taken)
            self._discard(prep.partition("/")[2])
            return False
        return True

    def _record_bad_row(self, task_id: str, row: BadRow) -> None:
        name = TaskName(key=queue_key(STAGE_FRESH, 0, row.index), id=task_id, gen=0,
                        attempts=0, resume=-1, producer="bad_row")
        body = {"task_id": task_id, "gen": 0, "attempts": 0, "reason": "bad_row",
                "message": row.message, "at": time.time(), "summary": row.to_dict()}
        log.error("dropping dataset row (task index %d): %s", row.index, row.message)
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
                self.storage.delete(cursor_key(name))
                if "/" in name:
                    self.storage.rmdir(cursor_key(CURSOR_DIRS.name(old)))
        # emptied by a crash mid-GC, or repaired
        for name in CURSOR_DIRS.below(self.storage.list(CURSOR_DIR), seq - KEEP_CURSORS + 1):
            self.storage.rmdir(cursor_key(name))

    @property
    def base(self) -> int:
        """The task index of the dataset's row 0 (0 unless the run switched datasets)."""
        return self._reader.base

    @property
    def exhausted(self) -> bool:
        """The last pass over the dataset has released its last row."""
        return self.cursor.exhausted and not self._epochs_left(self.cursor)

    def state_dict(self) -> dict[str, Any]:
        """The cursor for a trainer checkpoint (resume when the queue state is gone)."""
        return {"next_index": self.cursor.next_index, "seq": self.cursor.seq,
                "fingerprint": self._reader.fingerprint,
                **self.passes(self.cursor).record()}

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Start releasing at a checkpointed index (only on an empty, fresh queue), and
        release again the prompts the checkpoint lists as in flight (``in_flight``: released
        before its index, not trained by it; ``strawq.checkpoint.read_cursor_state``).
        Returns how many were released again.

        The cursor and the re-released prompts are one commit (``cursor/1`` names their
        release directory), so a crash leaves both or neither. ``DatasetMismatch`` if the
        checkpoint's fingerprint is not this dataset's; a checkpoint taken after a
        ``switch_dataset`` restores its offset too."""
        cur = self.refresh()
        nxt = int(state["next_index"])
        if not cur.seq:
            self._reader.adopt(state.get("fingerprint") or {}, nxt)
        bases, offsets = state.get("epoch_bases") or [], state.get("epoch_offsets") or []
        if not int_list(bases) or not isinstance(offsets, list) \
                or not all(int_list(o) for o in offsets):
            raise ValueError(f"checkpoint feeder state: epoch_bases must be a list of task "
                             f"indexes and epoch_offsets a list of lists of rows, got "
                             f"{bases!r} and {offsets!r}")
        passes = Passes.of(bases, offsets, self._reader.base, self.dataset.source_count)
        again = sorted({int(i) for i in state.get("in_flight") or () if int(i) < nxt})
        # In flight from any pass over this dataset is released again, each row read in its
        # own pass; only the prompts of a dataset before a switch are not.
        before = [i for i in again if i < passes.bases[0]]
        if before:
            log.warning("%d prompts in flight at the checkpoint come from the dataset before "
                        "the switch (indexes %d..%d): they are not released again",
                        len(before), before[0], before[-1])
            again = [i for i in again if i >= passes.bases[0]]
        staging = RELEASES.name(1, uuid.uuid4().hex[:8])
        good = 0 if cur.seq else self._stage(self.planner.rows_at(passes, again), staging,
                                             passes)
        if cur.seq or not self._commit(1, nxt, staging if good else None, False,
                                       restored_from_checkpoint=True, released_again=good,
                                       **passes.record()):
            if good:
                self._discard(staging)
            cur = self.refresh()
            raise AlreadyExists(17, f"the queue already has a cursor at index "
                                    f"{cur.next_index}; it wins over a checkpoint")
        if good:
            self._promote(self.read_cursor())
        elif self.storage.exists(f"staging/{staging}"):
            self.storage.rmdir(f"staging/{staging}")
        self.refresh()
        return good

    def switch_dataset(self, *, start_row: int = 0) -> Cursor:
        """Make this feeder's dataset the run's, on purpose: its row ``start_row`` becomes
        the next task index, so task ids continue and are never reused. Commits a new cursor
        (not exhausted) that records the new fingerprint; releases follow from it."""
        if start_row < 0:
            raise ValueError(f"start_row must be >= 0, got {start_row}")
        for _ in range(MAX_COMMIT_TRIES):
            cur = self.refresh()
            self._reader.base = cur.next_index - start_row
            if self._commit(cur.seq + 1, cur.next_index, None, False,
                            switched_from=cur.fingerprint, start_row=start_row):
                log.warning("switched the run's dataset to %s at task index %d (row %d)",
                            self.dataset.url, cur.next_index, start_row)
                return self.refresh()
        raise CursorContention(17, "the cursor kept changing while switching datasets")

    def continue_grown(self) -> Cursor:
        """Make this feeder's dataset the run's when it is the run's dataset with rows
        appended (``strawq.binding.growth_problem``; ``strawq release --dataset-grew``): the
        cursor keeps its index, base, passes and bad-row window, is no longer exhausted, and
        records the grown dataset's fingerprint, so later feeders take it with no flag.
        ``DatasetMismatch`` if its files say it did not only grow. A no-op for the run's
        own dataset."""
        for _ in range(MAX_COMMIT_TRIES):
            cur = self.refresh()
            if fingerprints_match(cur.fingerprint, self.dataset.fingerprint):
                self._reader.adopt(cur.fingerprint, cur.next_index)
                return cur
            problem = growth_problem(cur.fingerprint, self.dataset)
            if problem is not None:
                raise DatasetMismatch(mismatch_message(cur.fingerprint, self.dataset,
                                                       cur.next_index))
            self._reader.base = int(cur.fingerprint.get("base", 0) or 0)
            extra: dict[str, Any] = ({"epoch_bases": list(cur.epoch_bases)}
                                     if cur.epoch_bases else {})
            if self._commit(cur.seq + 1, cur.next_index, None, False,
                            grew_from=cur.fingerprint, recent=list(cur.recent), **extra):
                log.warning("the run's dataset grew: continuing over %s from task index %d "
                            "(the cursor records its new fingerprint)", self.dataset.url,
                            cur.next_index)
                return self.refresh()
        raise CursorContention(17, "the cursor kept changing while continuing a grown dataset")


def preview_release(queue: RunQueue, dataset: Dataset, count: int | None = None, *,
                    max_bad_row_share: float | None = None) -> ReleasePreview:
    """What ``Feeder(queue, dataset).release(count)`` would release, skip and drop, per
    source, read-only: the cursor does not move and nothing is written or recovered
    (``--dry-run``); a release the bad-row bound would refuse is reported as ``refused``."""
    count = queue.config.release_batch if count is None else count
    share = check_share(queue.config.max_bad_row_share if max_bad_row_share is None
                        else max_bad_row_share)
    if dataset.prompt_key != queue.config.prompt_key:
        raise DatasetMismatch(f"the dataset is read with prompt_key {dataset.prompt_key!r} "
                              f"but the run's is {queue.config.prompt_key!r}")
    state = read_cursor_state(queue.storage) or {"next_index": 0, "fingerprint": {},
                                                 "exhausted": False}
    fp = dict(state.get("fingerprint") or {})
    planner = ReleasePlanner(dataset, queue.config, queue.storage)
    exhausted = bool(state.get("exhausted"))
    nxt = int(state["next_index"])
    passes = Passes.of(state.get("epoch_bases") or (), state.get("epoch_offsets") or (),
                       int(fp.get("base", 0) or 0), dataset.source_count)
    if exhausted and (opened := planner.next_pass(passes, nxt)) is not None:
        # the pass ended, and the next one starts here (``Feeder._next_epoch``)
        fp["base"], exhausted, passes = nxt, False, opened
    judge: dict[str, Any] = {"max_share": share, "window": queue.config.release_batch,
                             "recent": state.get("recent") or (0, 0)}
    got = preview(dataset, fp, nxt, exhausted, count, offsets=passes.offsets[-1], **judge)
    segments = [(passes, got.start, got.end)]
    taken = got.end - got.start
    if got.refused is None and got.exhausted and taken < count \
            and (opened := planner.next_pass(passes, got.end)) is not None:
        # the release runs past the end of this pass into the next, as ``release`` does
        rest = preview(dataset, {**fp, "base": got.end}, got.end, False, count - taken,
                       offsets=opened.offsets[-1], **judge)
        kinds = dict(got.kinds)
        for k, v in rest.kinds.items():
            kinds[k] = kinds.get(k, 0) + v
        segments.append((opened, rest.start, rest.end))
        got = dataclasses.replace(rest, count=count, start=got.start, good=got.good + rest.good,
                                  bad=got.bad + rest.bad, kinds=kinds)
    if got.refused is not None:
        return got
    return dataclasses.replace(got, sources=_by_source(planner, segments))


def _by_source(planner: ReleasePlanner, segments: list[tuple[Passes, int, int]]
               ) -> dict[str, dict[str, int]]:
    """Per source, the rows the release's ``segments`` (one per pass) would release, skip
    and drop: the planner's decisions on the rows, as ``Feeder.release`` takes them."""
    out: dict[str, dict[str, int]] = {}
    for passes, start, end in segments:
        rows = planner.read(passes, start, end - start)
        skipped = {s.index for s in planner.plan(passes, rows).skips}
        for index, row in rows:
            name = planner.origin(passes, index).source or "dataset"
            what = "bad" if isinstance(row, BadRow) else "skip" if index in skipped \
                else "release"
            counts = out.setdefault(name, {"release": 0, "skip": 0, "bad": 0})
            counts[what] += 1
    return out
