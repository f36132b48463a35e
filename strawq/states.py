"""Task states and the transitions between them.

::

    dataset ──release──▶ PENDING ──claim──▶ LEASED ──complete──▶ READY ──batch──▶ BATCHED
                           ▲  ▲               │ │ │                 │                │
                           │  └─release/fail──┘ │ └─drop/fail(max)──┼──▶ DROPPED      │ack
                           │   (gen+1)          │                   │ (stale bound)  ▼
               PARTIAL ◀───┼───────yield────────┘                   │             TRAINED
                  │        └──────expire (grantor, gen+1)           │          (garbage, GC)
                  └──claim──▶ LEASED

Every arrow is one atomic rename (or exclusive create, for ``release``). Only the holder
of a lease — or the grantor, after expiry — can move a LEASED task; a stale holder finds
its file gone and gets ``LeaseLost``.
"""

from __future__ import annotations

import enum


class TaskState(str, enum.Enum):
    PENDING = "pending"
    PARTIAL = "partial"
    LEASED = "leased"
    READY = "ready"
    BATCHED = "batched"
    TRAINED = "trained"
    DROPPED = "dropped"


S = TaskState

#: (from, to) -> the operation that performs it, and who may call it.
TRANSITIONS: dict[tuple[TaskState, TaskState], str] = {
    (S.PENDING, S.LEASED): "claim (producer)",
    (S.PARTIAL, S.LEASED): "claim (producer)",
    (S.LEASED, S.READY): "complete (lease holder)",
    (S.LEASED, S.PARTIAL): "yield_partial (lease holder); expire/release with a saved prefix",
    (S.LEASED, S.PENDING): "release / fail retryable (lease holder); expire (grantor)",
    (S.LEASED, S.DROPPED): "drop / fail after max_attempts (holder); expire after max (grantor)",
    (S.READY, S.BATCHED): "publish_batch (collector)",
    (S.READY, S.DROPPED): "drop_ready (collector, staleness bound)",
    (S.READY, S.PARTIAL): "requeue_ready (collector, staleness bound)",
    (S.BATCHED, S.TRAINED): "ack (trainer) then gc (collector)",
}


def check_transition(src: TaskState, dst: TaskState) -> str:
    """Return the name of the operation for ``src -> dst``; ``ValueError`` if illegal."""
    try:
        return TRANSITIONS[(src, dst)]
    except KeyError:
        raise ValueError(f"illegal task transition {src.value} -> {dst.value}") from None
