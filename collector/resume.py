"""Opening a run for the collector, and the three resume paths.

``open_queue(path, checkpoint=...)`` decides which path a (re)start takes:

* ``queue``  — the run directory holds a readable run: everything on disk wins (pending,
  leased, partial, ready, batched work all survive; the checkpoint only fills in nothing).
* ``cursor`` — the queue state is missing or unreadable, the checkpoint has a dataset
  cursor: a warning, a fresh queue, the prompts that were in flight at the checkpoint
  (released, not trained by it: the cursor's ``in_flight``, written by
  ``strawq.delivery.checkpoint.read_cursor_state``) are released again, then
  releases resume at the checkpointed index; the weight version and the batch sequence
  continue from the checkpoint.
* ``fresh``  — no queue state and no cursor in the checkpoint: a warning, start from the
  dataset's beginning.
* ``new``    — no queue state and no checkpoint at all: a first start (no warning).

An unreadable run directory is never deleted: it is renamed to ``<path>.unreadable-<time>``
for inspection and a new one is created in its place.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strawq.config import QueueConfig
from strawq.data.cursor import read_cursor_state
from strawq.data.feeder import Feeder
from strawq.delivery.batches import mark_high_water
from strawq.errors import CorruptRecord, NotFound, StorageError
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import Storage, open_storage
from strawq.tasks.queue import RUN_KEY, RunQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeInfo:
    #: "queue", "cursor", "fresh" or "new" (see the module docstring)
    path: str
    message: str
    checkpoint: Mapping[str, Any] | None = None


def _queue_is_readable(storage: Storage) -> str | None:
    """None if the run record decodes; else why not."""
    try:
        records.decode(storage.read(RUN_KEY), expect=Kind.RUN, name=RUN_KEY)
    except NotFound:
        return "missing"
    except (CorruptRecord, StorageError) as exc:
        return f"unreadable ({exc})"
    return None


def run_cursor(path: str) -> dict[str, Any] | None:
    """The newest dataset cursor of the run at ``path`` (``strawq.data.cursor.read_cursor_state``),
    read without writing anything; None when ``path`` holds no readable run (``open_queue``
    then creates one, with no cursor)."""
    if not os.path.isdir(path):
        return None
    storage = open_storage(path, read_only=True)
    if _queue_is_readable(storage) is not None:
        return None
    return read_cursor_state(storage)


def open_queue(path: str, *, queue_config: QueueConfig | None = None,
               checkpoint: Mapping[str, Any] | None = None,
               writer_id: str = "collector", fsync: bool = True) -> tuple[RunQueue, ResumeInfo]:
    """Open (or create) the run at ``path`` and say which resume path applies."""
    os.makedirs(path, exist_ok=True)
    storage = open_storage(path, writer_id=writer_id, fsync=fsync)
    problem = _queue_is_readable(storage)
    if problem is None:
        queue = RunQueue.open(storage)
        return queue, ResumeInfo("queue", f"queue state intact at {path}", checkpoint)
    if problem != "missing":
        aside = f"{os.path.abspath(path).rstrip('/')}.unreadable-{int(time.time())}"
        os.rename(path, aside)
        os.makedirs(path)
        storage = open_storage(path, writer_id=writer_id, fsync=fsync)
        log.warning("queue state at %s is %s; moved it to %s for inspection", path, problem,
                    aside)
    queue = RunQueue.create(storage, queue_config)
    if checkpoint is None:
        if problem != "missing":
            log.warning("no checkpoint given either: starting from the dataset's beginning")
            return queue, ResumeInfo("fresh", "queue unreadable, no checkpoint", None)
        return queue, ResumeInfo("new", f"new run at {path}", None)
    feeder = checkpoint.get("feeder") if isinstance(checkpoint, Mapping) else None
    if feeder and "next_index" in feeder:
        again = feeder.get("in_flight")
        what = (f"the {len(again)} prompts in flight at the checkpoint are released again"
                if again is not None else
                "the checkpoint lists no prompts in flight, so prompts released before its "
                "index and not trained by it are not generated again")
        log.warning("queue state at %s is %s: resuming from the checkpoint's dataset cursor "
                    "(index %s, version %s, last batch %s); %s", path, problem,
                    feeder["next_index"], checkpoint.get("version"),
                    checkpoint.get("batch_seq"), what)
        return queue, ResumeInfo("cursor", f"queue {problem}; cursor from checkpoint",
                                 checkpoint)
    log.warning("queue state at %s is %s and the checkpoint has no dataset cursor: starting "
                "from the dataset's beginning", path, problem)
    return queue, ResumeInfo("fresh", f"queue {problem}; no cursor in checkpoint", checkpoint)


def apply_checkpoint(queue: RunQueue, feeder: Feeder, resume: ResumeInfo) -> None:
    """Apply the checkpoint of a ``cursor`` or ``fresh`` resume to a collector just started:
    the feeder's cursor (``cursor`` only: the prompts in flight at it are released again),
    the weight version, and the batch numbers (they continue after the checkpoint's: names
    are never reused)."""
    if resume.path not in ("cursor", "fresh") or not resume.checkpoint:
        return
    ckpt = resume.checkpoint
    if resume.path == "cursor":
        again = feeder.load_state_dict(dict(ckpt["feeder"]))
        if again:
            log.warning("released %d prompts again that were in flight at the checkpoint "
                        "(released, not trained by it)", again)
    version = int(ckpt.get("version") or 0)
    if version > queue.current_version():
        queue.set_version(version)
    seq = int(ckpt.get("batch_seq") or 0)
    if seq > 0:
        mark_high_water(queue.storage, seq)
