"""The run's end: a durable "run finished" record every part reads.

The collector publishes it once the run has drained (the dataset's last pass is released
and every group is trained or dropped: every batch acked)::

    finished        {"last_seq": N, "epoch": E, "time": T}   (JSON; the name is the record)

From then on the trainer's ``BatchReader.next_batch`` raises ``RunFinished`` instead of
waiting for a batch that is not coming, and producers exit 0. A collector that starts on a
run removes the record first (``clear``): a run continued with more data (``--dataset-grew``,
a larger ``queue.num_epochs``) is no longer finished, and the collector publishes it again
when that run drains.
"""

from __future__ import annotations

import json
import time
from typing import Any

from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.storage import Storage

FINISHED = "finished"


def mark_finished(storage: Storage, last_seq: int, epoch: int) -> None:
    """Record that the run has drained: ``last_seq`` is its last batch (0: none)."""
    body = json.dumps({"last_seq": int(last_seq), "epoch": int(epoch), "time": time.time()},
                      sort_keys=True).encode()
    try:
        storage.publish(FINISHED, body)
    except AlreadyExists:
        pass  # published by this epoch's earlier pass (or a predecessor's): same meaning


def finished(storage: Storage) -> dict[str, Any] | None:
    """The run's "finished" record, or None while the run goes on. One stat while absent."""
    if not storage.exists(FINISHED):
        return None
    try:
        body = json.loads(storage.read(FINISHED))
    except NotFound:
        return None  # cleared in between (a collector restarted with more data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptRecord(f"{FINISHED} record unreadable: {exc}") from exc
    return body if isinstance(body, dict) else {}


def clear(storage: Storage) -> None:
    """The run goes on (a collector started on it): remove the record."""
    storage.delete(FINISHED)
