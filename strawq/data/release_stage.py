"""A release's rows written out of sight: each good row a fresh task record in
``staging/r-<seq>.<nonce>/`` (fsync'd, not yet visible), each bad row dropped with its reason.

Nothing here is visible to a producer until the feeder commits the cursor naming the staging
directory and renames it to ``pending/r-<seq>`` (``strawq.data.feeder``,
``strawq.data.cursor_log``). A bad row's note and ``dropped/`` entry are exclusive creates, so a
redo of the release records each once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from strawq.data.dataset import BadRow
from strawq.data.planner import Passes, ReleasePlanner, Rows
from strawq.data.prompt_policy import Plan
from strawq.errors import AlreadyExists
from strawq.ondisk import records
from strawq.ondisk.names import CHUNK_ROWS, STAGE_FRESH, ChunkName, TaskName, dataset_task_id, \
    fresh_key, note_key, queue_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.states import DIRS, TaskState, key_of

log = logging.getLogger(__name__)

#: rows staged between two calls of ``Feeder.on_progress``
PROGRESS_EVERY = 500


def stage_rows(storage: Storage, planner: ReleasePlanner, rows: Rows, staging: str,
               passes: Passes, plan: Plan | None = None,
               on_progress: Callable[[int, int], None] | None = None, *,
               chunk: int = 1) -> int:
    """Write ``rows`` as fresh tasks into ``staging/<staging>/`` (bad rows are dropped
    with a record); returns how many were staged. ``plan``: stage only its rows, the
    i-th of its order under the release's i-th order number (claims go in key order), with
    the length it was ranked by as its claim rank (``fresh_key``).
    ``on_progress(staged, rows)`` every ``PROGRESS_EVERY`` rows. ``chunk`` > 1
    (``queue.release_chunk``): the tasks go into chunk directories of ``chunk`` tasks each
    (``stage_chunk``), the last one with what is left."""
    good = 0
    held: list[tuple[TaskName, dict[str, Any]]] = []
    chunks: list[str] = []
    skipped = {s.index for s in plan.skips} if plan else set()
    order = dict(zip(plan.order, sorted(plan.order), strict=True)) if plan else {}
    for done, (index, row) in enumerate(rows):
        if on_progress is not None and done % PROGRESS_EVERY == 0:
            on_progress(done, len(rows))
        task_id = dataset_task_id(index)
        if isinstance(row, BadRow):
            record_bad_row(storage, task_id, row)
            continue
        if index in skipped:
            continue
        name = TaskName(key=fresh_key(order.get(index, index),
                                      plan.ranked.get(index) if plan else None,
                                      plan.version if plan else 0),
                        id=task_id, gen=0, attempts=0, resume=-1)
        body = {"task": planner.task(passes, index, row)}
        good += 1
        if chunk > 1:
            held.append((name, body))
            if len(held) == chunk:
                chunks.append(stage_chunk(storage, staging, len(chunks), held))
                held = []
            continue
        # In place: nobody reads a staging directory before its rename to pending/,
        # which comes after every record in it was written, fsync'd and closed (no
        # temporary file and rename per record: docs/protocol.md §5).
        storage.publish(f"staging/{staging}/{name}", records.encode(Kind.TASK, body),
                        sync_dir=False, in_place=True)
    if held:  # the last chunk, smaller: every task of the release is in a chunk, whose
        # names sort in dataset order (a task of its own would sort before them all)
        chunks.append(stage_chunk(storage, staging, len(chunks), held))
    # The staging directory exists only once a good row was staged in it.
    storage.sync_dirs(chunks + [f"staging/{staging}"] * bool(good)
                      + ["staging", DIRS[TaskState.DROPPED]])
    return good


def stage_chunk(storage: Storage, staging: str, index: int,
                tasks: list[tuple[TaskName, dict[str, Any]]]) -> str:
    """Write one chunk directory of a release (a range claim, ``queue.release_chunk``):
    ``staging/<staging>/k-<index>~n<k>/`` holding each task's record under its queued name
    — an ordinary task wherever it goes once it leaves the chunk — and ``CHUNK_ROWS``, every
    row in one record, which a claim of the whole chunk reads once. In place, like every
    record of a staging directory (its rename publishes them); returns the directory, which
    the caller fsyncs."""
    directory = f"staging/{staging}/{ChunkName(0, index, len(tasks)).queued()}"
    for name, body in tasks:
        storage.publish(f"{directory}/{name}", records.encode(Kind.TASK, body),
                        sync_dir=False, in_place=True)
    rows = {"rows": {str(name): body["task"] for name, body in tasks}}
    storage.publish(f"{directory}/{CHUNK_ROWS}", records.encode(Kind.TASK, rows),
                    sync_dir=False, in_place=True)
    return directory


def record_bad_row(storage: Storage, task_id: str, row: BadRow) -> None:
    """Drop a malformed dataset row with its reason: a ``bad_row`` note, then the
    ``dropped/`` entry, each by exclusive create (a redo is a no-op)."""
    name = TaskName(key=queue_key(STAGE_FRESH, 0, row.index), id=task_id, gen=0,
                    attempts=0, resume=-1, producer="bad_row")
    body = {"task_id": task_id, "gen": 0, "attempts": 0, "reason": "bad_row",
            "message": row.message, "at": time.time(), "summary": row.to_dict()}
    log.error("dropping dataset row (task index %d): %s", row.index, row.message)
    # dataset -> DROPPED: the note, then the entry, each by exclusive create
    for key, kind in ((note_key(task_id, 0, "drop", "bad_row"), Kind.DROP),
                      (key_of(TaskState.DROPPED, name), Kind.DROP)):
        try:
            storage.publish(key, records.encode(kind, body), sync_dir=False)
        except AlreadyExists:
            pass
