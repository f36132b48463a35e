"""The release of prompt tasks from a dataset (the feeder): a driver that asks the release
planner (``strawq.data.planner``) what to release and publishes it.

A release of rows ``[start, end)`` is made idempotent by preparing it out of sight and
committing it with one exclusive create:

0. judge the rows' bad share (``strawq.data.release_check.judge_release``, ``max_bad_row_share``): a
   release that would drop too many is refused before anything is written (``BadRowsRefused``:
   the cursor does not move);
1. write every task record into ``staging/r-<seq>.<nonce>/`` (fsync'd, not yet visible);
   malformed rows are recorded in ``dropped/`` (exclusive create, so a redo is a no-op)
   (``strawq.data.release_stage``);
2. publish ``cursor/<seq>`` naming ``end`` and the staging directory — the commit point;
3. rename the staging directory to ``pending/r-<seq>`` — one atomic move of all its tasks
   (2 and 3: ``strawq.data.cursor_log``).

A crash before 2 leaves an uncommitted staging directory: ``recover`` deletes it and the
next release redoes the range. A crash between 2 and 3 leaves a committed one: ``recover``
finishes step 3. No index is ever released twice, and none is skipped. The read-only
preview of a release (``--dry-run``) is ``strawq.data.release_preview``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from strawq.data.binding import DatasetMismatch, fingerprints_match, require_rows
from strawq.data.cursor import Cursor, newest_seq, read_cursor_state
from strawq.data.cursor_log import MAX_COMMIT_TRIES, CursorContention, CursorLog
from strawq.data.dataset import BadRow, Dataset, Row
from strawq.data.history import record_attempts
from strawq.data.planner import Passes, ReleasePlanner, Rows
from strawq.data.prompt_policy import Plan, skip_rows
from strawq.data.release_check import BadRowsRefused, judge_release, refusal_message
from strawq.data.release_preview import check_share, preview_release
from strawq.data.release_stage import PROGRESS_EVERY, stage_rows
from strawq.errors import AlreadyExists, NotFound, StorageError
from strawq.ondisk.names import dataset_task_id
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import RELEASES

log = logging.getLogger(__name__)

__all__ = ["MAX_COMMIT_TRIES", "PROGRESS_EVERY", "CursorContention", "Feeder", "check_share",
           "preview_release", "read_cursor_state"]


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
        #: the decisions of every release (``strawq.data.planner``); this class makes them durable
        self.planner = ReleasePlanner(dataset, queue.config, queue.storage)
        self._reader = self.planner.reader
        #: the cursor records and release directories on disk (``strawq.data.cursor_log``)
        self.cursor_log = CursorLog(queue.storage, self._reader, dataset.source_count,
                                    queue.quarantine)
        #: called as ``on_progress(staged, rows)`` every ``PROGRESS_EVERY`` rows a release
        #: stages (``strawq release`` shows it: a long release is not silent); None: quiet
        self.on_progress: Callable[[int, int], None] | None = None
        #: rows this feeder's releases skipped by the history's rule (``prompt_policy``)
        self.skipped_total = 0
        self._skipped: list[str] = []
        self.recover()
        if check_dataset:
            self._reader.adopt(self.cursor.fingerprint, self.cursor.next_index)

    # -- cursor ------------------------------------------------------------------------------
    @property
    def cursor(self) -> Cursor:
        """The cursor this feeder last read or committed."""
        return self.cursor_log.current

    @cursor.setter
    def cursor(self, cur: Cursor) -> None:
        self.cursor_log.current = cur

    def read_cursor(self) -> Cursor:
        """The latest committed cursor (a fresh run starts at index 0)."""
        return self.cursor_log.read()

    def refresh(self) -> Cursor:
        """Re-read the newest cursor and finish its release (promote, repair a bad record)."""
        return self.cursor_log.refresh()

    def recover(self) -> Cursor:
        """Finish a committed release and delete abandoned staging. Reads O(in flight).

        Safe beside live writers: only staging at or below the newest committed sequence
        number is abandoned (a writer still preparing it will lose its commit); staging for
        a higher number may belong to a writer in the middle of a release and is left alone.
        """
        cur = self.refresh()
        self.cursor_log.discard_abandoned(cur.seq, keep=cur.staging)
        if not fingerprints_match(cur.fingerprint, self.dataset.fingerprint):
            # Nothing is released from it: a release re-checks the fingerprint, and refuses
            # until the run is switched to it or continues it as grown.
            log.debug("%s is not the dataset the cursor at index %d counts over",
                      self.dataset.url, cur.next_index)
        return cur

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
        """The passes over the dataset ``cur`` records (``strawq.data.planner``)."""
        return self.cursor_log.passes(cur)

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
        won = self.cursor_log.commit(cur.seq + 1, cur.next_index, None, False, **nxt.record())
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
        if plan.ranked:  # claim ranks start with the version (``fresh_key``)
            plan.version = self.queue.current_version()
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
            self.cursor_log.discard(staging)
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

    def _stage_and_commit(self, cur: Cursor, rows: Rows, n: int, seq: int, staging: str,
                          recent: tuple[int, int], plan: Plan) -> int | None:
        passes = self.passes(cur)
        try:
            good = stage_rows(self.storage, self.planner, rows, staging, passes, plan,
                              self.on_progress, chunk=self.queue.config.release_chunk)
        except StorageError:  # refused (a full disk): what it staged goes, not left behind
            self.cursor_log.discard_quietly(staging)
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
        won = self.cursor_log.commit(seq, end, new.staging, exhausted, start=cur.next_index,
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
            self.cursor_log.discard(staging)
            return None
        if good:
            self.cursor_log.promote(new)
        else:
            self.storage.rmdir(f"staging/{staging}")
        self.cursor = new
        self.cursor_log.gc(seq)
        self.cursor_log.discard_abandoned(seq, level=logging.INFO)
        return len(rows)

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
        before its index, not trained by it; ``strawq.delivery.checkpoint.read_cursor_state``).
        Returns how many were released again.

        The cursor and the re-released prompts are one commit (``cursor/1`` names their
        release directory), so a crash leaves both or neither. ``DatasetMismatch`` if the
        checkpoint's fingerprint is not this dataset's; a checkpoint taken after a
        ``switch_dataset`` restores its offset too."""
        cur = self.refresh()
        nxt = int(state["next_index"])
        if not cur.seq:
            self._reader.adopt(state.get("fingerprint") or {}, nxt)
        passes, again = self.cursor_log.checkpoint_rows(state)
        staging = RELEASES.name(1, uuid.uuid4().hex[:8])
        good = 0 if cur.seq else stage_rows(self.storage, self.planner,
                                            self.planner.rows_at(passes, again), staging,
                                            passes, on_progress=self.on_progress,
                                            chunk=self.queue.config.release_chunk)
        if cur.seq or not self.cursor_log.commit(1, nxt, staging if good else None, False,
                                       restored_from_checkpoint=True, released_again=good,
                                       **passes.record()):
            if good:
                self.cursor_log.discard(staging)
            cur = self.refresh()
            raise AlreadyExists(17, f"the queue already has a cursor at index "
                                    f"{cur.next_index}; it wins over a checkpoint")
        if good:
            self.cursor_log.promote(self.cursor_log.read())
        elif self.storage.exists(f"staging/{staging}"):
            self.storage.rmdir(f"staging/{staging}")
        self.refresh()
        return good

    def switch_dataset(self, *, start_row: int = 0) -> Cursor:
        """Make this feeder's dataset the run's, on purpose: its row ``start_row`` becomes
        the next task index, so task ids continue and are never reused. Commits a new cursor
        (not exhausted) that records the new fingerprint; releases follow from it."""
        return self.cursor_log.switch(start_row)

    def continue_grown(self) -> Cursor:
        """Make this feeder's dataset the run's when it is the run's dataset with rows
        appended (``strawq.data.binding.growth_problem``; ``strawq release --dataset-grew``): the
        cursor keeps its index, base, passes and bad-row window, is no longer exhausted, and
        records the grown dataset's fingerprint, so later feeders take it with no flag.
        ``DatasetMismatch`` if its files say it did not only grow. A no-op for the run's
        own dataset."""
        return self.cursor_log.grow()
