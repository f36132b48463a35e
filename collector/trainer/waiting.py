"""A rank waiting for the next manifest: change events or a cheap probe, the run's end, and
a timeout that says why nothing came.

``ManifestWait.next_manifest`` lists ``batches/`` at once, then again when an inotify event
arrives (``DirWatch``, where this host sees the writes) or the probe says the folder changed
(``DirProbe``: one stat a poll, a full listing at least every ``LIST_EVERY_S``), at a fixed
poll interval. A manifest of a superseded collector epoch is refused, never delivered. Once
the collector's ``finished`` record is there and no batch is left for this reader it raises
``RunFinished``; after ``timeout`` seconds ``BatchTimeout``, with the queue's depths and what
they mean.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from strawq.data.cursor import read_cursor_state as cursor_state
from strawq.delivery.batches import BatchStore, Manifest, queue_depths
from strawq.errors import BatchTimeout, NotFound, RunFinished
from strawq.storage.watch import DirProbe, DirWatch
from strawq.tasks.epochs import epoch_starts, superseded
from strawq.tasks.epochs import epochs as known_epochs
from strawq.tasks.epochs import list_names as list_epoch_names
from strawq.tasks.finished import finished
from strawq.tasks.queue import RunQueue


log = logging.getLogger(__name__)

#: A waiting rank on a mount without change events lists ``batches/`` at least this often
#: (it stats it at every poll and lists at once when it changed; on a FUSE mount the stat
#: is answered from the attribute cache, so a new manifest is seen within that TTL).
LIST_EVERY_S = 1.0


class ManifestWait:
    """Waits for the manifest ``next_seq()`` names, for one reader."""

    def __init__(self, queue: RunQueue, batches: BatchStore, *,
                 next_seq: Callable[[], int | None], refused: set[int],
                 delivered: Callable[[], int], poll_interval_s: float,
                 clock: Callable[[], float], sleep: Callable[[float], None],
                 watch: DirWatch | None = None) -> None:
        self.queue = queue
        self.storage = queue.storage
        self.batches = batches
        self._next_seq = next_seq
        self._refused = refused
        self._delivered = delivered
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.sleep = sleep
        # Wait for a new manifest on inotify where this host sees it (the default sleep
        # only: an injected sleep means an injected clock), else a fixed poll (no back-off).
        if watch is None and sleep is time.sleep:
            watch = DirWatch(self.storage, ("batches",))
        self.watch = watch if watch is not None and watch.event_driven else None
        # A waiting rank stats batches/ at each poll and lists it only when it changed, or
        # once a LIST_EVERY_S: no event comes for another host's manifest on a shared mount
        # (inotify on a FUSE mount sees this client's changes only), and a listing of
        # batches/ and acked/ every 20 ms was ~320 metadata operations a second per rank on
        # JuiceFS (bench/scale.py, "a waiting trainer rank").
        self.probe: DirProbe | None = DirProbe(self.storage, ("batches",),
                                               full_every_s=LIST_EVERY_S, clock=clock)

    def next_manifest(self, timeout: float) -> tuple[int, Manifest]:
        """The next manifest to deliver and its number; ``RunFinished``, ``BatchTimeout``."""
        start = self.clock()
        look = True  # list now; later, when the probe says batches/ changed
        end_checked = float("-inf")
        while True:
            seq = self._next_seq() if look or self.probe is None or self.probe.changed() \
                else None
            look = False
            if seq is not None:
                look = True  # whatever happens to this one, list again at once
                try:
                    man = self.batches.read_manifest(seq)
                except NotFound:
                    continue  # acked and collected in between (another reader process)
                by = superseded(seq, man.meta, epoch_starts(self.storage))
                if by is None:
                    return seq, man
                log.error("batch %d comes from collector epoch %s, published after epoch %d "
                          "took over: refused (its groups are batched again by the live "
                          "collector)", seq, man.meta.get("epoch"), by)
                self._refused.add(seq)
                continue
            now = self.clock()
            if now - end_checked >= LIST_EVERY_S:  # one stat, at most once a second
                end_checked = now
                self.check_finished()
            waited = now - start
            if waited >= timeout:
                raise BatchTimeout(self.timeout_message(timeout))
            # A fixed interval: a doubling one (it reached 0.5 s) left a manifest published
            # just after a listing unseen for up to that long while the trainer idled.
            pause = min(self.poll_interval_s, max(timeout - waited, 0.0))
            if self.watch is not None:
                look = self.watch.wait(pause)  # an event: list, whatever the mtime says
            else:
                self.sleep(pause)

    def check_finished(self) -> None:
        """``RunFinished`` when the run's ``finished`` record is there and, listed after it,
        no batch is left for this reader (the record is published after the last ack)."""
        end = finished(self.storage)
        if end is None or self._next_seq() is not None:
            return
        raise RunFinished(
            f"the run has finished: the dataset's last pass is trained (last batch "
            f"{end.get('last_seq')}, this reader's last {self._delivered()}); no batch is "
            "coming. Save and commit the last checkpoint and stop the trainer.")

    def timeout_message(self, timeout: float) -> str:
        d = queue_depths(self.storage)
        head = (f"no batch after {timeout:.1f}s (expected batch > {self._delivered()}); "
                f"queue: pending={d.pending + d.partial} leased={d.leased} ready={d.ready}")
        cursor = cursor_state(self.storage)
        last_pass = cursor is not None and max(len(cursor.get("epoch_bases") or ()), 1) \
            >= self.queue.config.num_epochs
        if cursor is not None and cursor.get("exhausted") and last_pass and not (
                d.pending or d.partial or d.leased or d.ready):
            # the last pass is released and nothing is left to generate or batch
            return (f"{head}. The run has drained: the dataset's last pass is released (cursor "
                    f"at index {cursor.get('next_index')}) and every group is trained or "
                    "dropped ('strawq inspect RUN dropped' lists why); no batch is coming. "
                    "Train fewer steps, or release more (queue.num_epochs, a larger dataset).")
        epochs = known_epochs(list_epoch_names(self.storage))
        return (f"{head}; collector epochs {epochs or 'none'}. Is the collector running "
                "('strawq collector') and are producers claiming work?")

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.probe is not None:
            self.probe.close()
            self.probe = None
