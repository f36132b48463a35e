"""The trainer's committed position: trained means checkpointed.

A batch the trainer acked is consumed (it frees admission capacity), but it is *trained*
only once a checkpoint that includes it is durable. The trainer says so by committing the
checkpoint's batch number (like a consumer group's committed offset)::

    committed/<seq>      the newest checkpoint covers every batch <= seq (the name is the data)

Garbage collection deletes an acked batch only at or below the committed number, so a
trainer restored from its newest checkpoint gets every batch after it again, whatever the
checkpoint interval. Without any ``committed/`` record (a run whose consumer never
checkpoints, or tools) an ack alone lets GC collect the batch.

Commits only move forward: the newest record wins, older ones are deleted after it is
published (a crash in between leaves two; the higher one counts).
"""

from __future__ import annotations

import logging

from strawq.errors import AlreadyExists
from strawq.ondisk.numbered import Numbered
from strawq.storage import Storage

log = logging.getLogger(__name__)

COMMITTED = "committed"
COMMITS = Numbered()


def committed_seq(storage: Storage) -> int | None:
    """The committed batch number; None when no consumer ever committed (ack = trained)."""
    return COMMITS.newest(storage.list(COMMITTED))


def commit(storage: Storage, seq: int) -> int:
    """Record that a durable checkpoint covers every batch <= ``seq``; returns the position.

    Never moves backwards: a lower ``seq`` than the recorded one is a no-op.
    """
    if seq < 0:
        raise ValueError(f"a committed batch number is >= 0, got {seq}")
    current = committed_seq(storage)
    if current is not None and seq <= current:
        return current
    try:
        storage.publish(f"{COMMITTED}/{COMMITS.name(seq)}", b"")
    except AlreadyExists:
        pass
    for n in COMMITS.below(storage.list(COMMITTED), seq):
        storage.delete(f"{COMMITTED}/{n}")
    return seq


def hold(storage: Storage, start: int) -> int:
    """Turn on retention for a checkpointing consumer: from now on GC waits for commits.

    ``start`` is the highest batch number already garbage-collected (nothing after it may
    go before a checkpoint covers it). Returns the committed position.
    """
    current = committed_seq(storage)
    return current if current is not None else commit(storage, start)
