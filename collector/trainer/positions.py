"""A reader's positions in the run's batches: what it delivered, acked and checkpointed.

Training is exactly-once when the trainer acks after its step and commits each checkpoint:
a batch at or below a restored checkpoint's ``batch_seq`` is never delivered again (acked on
the spot if it was not); a checkpointing trainer (``checkpointed``) gets every batch after
the committed position again after a restart, acked or not (its model has none of them).
Manifests of a superseded collector epoch are remembered as ``refused``, never delivered.

``BatchReader`` delivers through ``next_seq`` and exposes the checkpoint calls
(``state_dict``, ``checkpoint_state``, ``commit``, ``load_state_dict``) of this part. Only
rank 0 writes, after ``writer()`` (the trainer fence).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from strawq.delivery.batches import BatchStore, forget_delivered_after, high_water
from strawq.delivery.checkpoint import CHECKPOINT_FORMAT, read_cursor_state
from strawq.delivery.commits import commit as commit_position
from strawq.delivery.commits import committed_seq, hold
from strawq.tasks.queue import RunQueue

log = logging.getLogger(__name__)


class ReaderPositions:
    """Delivered, acked, skipped, replayed and saving positions of one rank's reader."""

    def __init__(self, queue: RunQueue, batches: BatchStore, *, rank: int,
                 checkpointed: bool, writer: Callable[[], None]) -> None:
        self.queue = queue
        self.storage = queue.storage
        self.batches = batches
        self.rank = rank
        #: the trainer restores from checkpoints: acked batches stay until ``commit``
        self.checkpointed = checkpointed
        self._writer = writer
        self.delivered = 0
        self.acked = 0
        #: the restored checkpoint's position: never delivered again at or below it
        self.skip_upto = 0
        #: batches after this number are delivered (again) whether acked or not: the
        #: committed position when this reader started, or the restored checkpoint's
        self.replay_after: int | None = None
        #: the position of the checkpoint being saved (committed by ``commit``, or by the
        #: next ``state_dict``: a trainer saves one checkpoint at a time)
        self.saving: int | None = None
        #: manifests from a superseded collector epoch (never delivered)
        self.refused: set[int] = set()

    def _start_replay(self) -> None:
        """First delivery: a checkpointing trainer re-reads every batch after the committed
        position (its model has none of them, whatever it acked before a crash)."""
        if not self.checkpointed or self.replay_after is not None:
            return
        if self.rank == 0:
            hold(self.storage, high_water(self.storage))
        pos = committed_seq(self.storage)
        if pos is not None:
            self.replay_after = max(pos, self.skip_upto)

    def next_seq(self) -> int | None:
        """The number of the next batch to deliver now, or None."""
        self._start_replay()
        seqs, acked = self.batches.batch_seqs()
        replay = self.replay_after
        for s in sorted(seqs):
            if s in acked and (replay is None or s <= replay):
                continue
            if s <= self.skip_upto:
                log.warning("batch %d is at or below the checkpoint's batch %d but was not "
                            "acked (the trainer stopped between its checkpoint and the ack); "
                            "acking it now, it is not trained again", s, self.skip_upto)
                if self.rank == 0:
                    self.batches.ack(s)
                continue
            if s <= self.delivered or s in self.refused:
                continue
            return s
        return None

    def ack(self, seq: int) -> None:
        if self.rank == 0:
            self._writer()
            self.batches.ack(seq)
        self.acked = max(self.acked, seq)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        state = self.checkpoint_state(consumed)
        if self.saving is not None and self.rank == 0 and self.checkpointed:
            self._writer()
            commit_position(self.storage, self.saving)
        self.saving = int(state["batch_seq"])
        return state

    def checkpoint_state(self, consumed: int | None = None) -> dict[str, Any]:
        seq = self.acked if consumed is None else max(self.acked, consumed)
        return {"format": CHECKPOINT_FORMAT, "batch_seq": seq,
                "version": self.queue.current_version(),
                "feeder": read_cursor_state(self.storage, trained_through=seq)}

    def commit(self, state: Mapping[str, Any] | int | None = None) -> int:
        if self.rank == 0:
            self._writer()  # refused: the checkpoint being saved stays pending
        if isinstance(state, Mapping):
            seq = int(state.get("batch_seq") or 0)
        elif state is not None:
            seq = int(state)
        elif self.saving is not None:
            seq = self.saving
        else:
            raise ValueError("commit() before state_dict(): nothing to commit")
        if self.saving is not None and seq >= self.saving:
            self.saving = None
        if self.rank != 0:
            return seq
        return commit_position(self.storage, seq)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format {state.get('format')!r}, this reader reads "
                             f"{CHECKPOINT_FORMAT}")
        seq = int(state.get("batch_seq") or 0)
        if self.rank == 0:
            self._writer()  # refused: nothing of the reader's state moved
        self.acked = max(self.acked, seq)
        self.skip_upto = max(self.skip_upto, seq)
        self.delivered = max(self.delivered, seq)
        if self.rank == 0:  # batches after it are trained again: not in the weights
            forget_delivered_after(self.storage, seq, acks=self.checkpointed)
        if self.checkpointed:
            if self.rank == 0:
                commit_position(self.storage, seq)  # a checkpoint being restored is durable
            retired = high_water(self.storage)
            if retired > seq:
                log.error("batches %d..%d after this checkpoint were garbage-collected before "
                          "a checkpoint covering them was committed; they cannot be trained "
                          "again. Restore the newest checkpoint, and call reader.commit() "
                          "after each save", seq + 1, retired)
            self.replay_after = seq
        v = int(state.get("version") or 0)
        if v != self.queue.current_version():
            log.info("checkpoint was at weight version %d, the queue announces %d", v,
                     self.queue.current_version())
