"""What a trainer checkpoint records of the run: its format and the dataset cursor.

``read_cursor_state`` is the cursor a trainer saves beside its weights (``BatchReader.
state_dict``), read-only, with ``in_flight``: the prompts released and not trained by that
checkpoint. A collector that restarts on a lost queue from that checkpoint
(``strawq.collector.resume``) releases them again before it continues from the cursor's
index. Both sides read it from here: the trainer library never imports the collector
process.
"""

from __future__ import annotations

from typing import Any

from strawq.data.cursor import read_cursor_state as feeder_cursor_state
from strawq.delivery.batches import BatchStore
from strawq.errors import CorruptRecord, NotFound
from strawq.ondisk.names import TASK_IDS
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in

#: the format of the checkpoint state ``BatchReader.state_dict`` returns
CHECKPOINT_FORMAT = 1


#: states whose tasks were released and are not trained, listed in the direction work flows
#: (a task that moves on between two listings is seen twice, never missed)
_IN_FLIGHT = (TaskState.PENDING, TaskState.PARTIAL, TaskState.LEASED, TaskState.READY,
              TaskState.BATCHED)


def read_cursor_state(storage: Storage, trained_through: int | None = None
                      ) -> dict[str, Any] | None:
    """The newest cursor in ``Feeder.state_dict()`` form, read-only (no recovery side
    effects), with ``in_flight``: the dataset indexes of the prompts released before the
    cursor and not trained by a checkpoint covering batches ``<= trained_through``.

    The trainer side uses this for its checkpoint (``BatchReader.state_dict``); a cursor
    resume releases ``in_flight`` again before it releases from ``next_index``, so nothing
    that was in flight is skipped (``Feeder.load_state_dict``). In flight: queued, leased
    and ready tasks, and the groups of batches after ``trained_through`` (default: the
    unacked batches). Constructing a ``Feeder`` runs its recovery, which only the collector
    may do; this reads.
    """
    cursor = feeder_cursor_state(storage)
    if cursor is None:
        return None
    keys = ("next_index", "seq", "fingerprint", "epoch_bases", "epoch_offsets")
    out: dict[str, Any] = {k: cursor[k] for k in keys if k in cursor}
    out["in_flight"] = sorted(i for i in in_flight(storage, trained_through)
                              if i < int(out["next_index"]))
    return out


def in_flight(storage: Storage, trained_through: int | None = None) -> set[int]:
    """Dataset indexes of released prompts not trained by batches ``<= trained_through``
    (None: by the acked batches)."""
    out: set[int] = set()
    batched: dict[str, int] = {}
    for state in _IN_FLIGHT:
        for name in names_in(storage, state):
            # the task's dataset index is in its id: a name's order number is not it once a
            # release staged its rows longest-first (``strawq.data.prompt_policy``)
            index = TASK_IDS.parse(name.id)
            if index is None:
                continue  # not a dataset row
            if state in (TaskState.READY, TaskState.BATCHED):
                # a batched group's entry stays in ready/: a ready entry is in flight
                # unless a trained batch names it
                batched[str(name)] = index
            else:
                out.add(index)
    store = BatchStore(RunQueue(storage))
    seqs, acked = store.batch_seqs()
    trained: set[str] = set()
    for seq in seqs:
        done = seq in acked if trained_through is None else seq <= trained_through
        if not done:
            continue
        try:
            trained.update(str(n) for n in store.read_manifest(seq).groups)
        except (NotFound, CorruptRecord):
            continue  # collected meanwhile (trained), or quarantined (its groups go back)
    out.update(order for name, order in batched.items() if name not in trained)
    return out
