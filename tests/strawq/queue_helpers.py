"""Helpers of the queue tests (tests/strawq/test_queue_*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.ondisk.names import dataset_task_id
from strawq.storage import Storage
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing import write_jsonl
from strawq.testing.factories import prompts


class FakeClock:
    """A monotonic clock the test moves by hand (the grantor's clock in the lease tests)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_queue(storage: Storage, **cfg: Any) -> RunQueue:
    """A new run on ``storage``: a 10 s lease timeout and 1 s heartbeats unless ``cfg`` says."""
    cfg.setdefault("lease_timeout_s", 10.0)
    cfg.setdefault("heartbeat_interval_s", 1.0)
    return RunQueue.create(storage, QueueConfig(**cfg))


def make_feeder(q: RunQueue, tmp_path: Path, rows: list[Any] | int,
                name: str = "data.jsonl") -> Feeder:
    """A feeder over a JSONL dataset of ``rows`` (or that many generated prompts)."""
    data = prompts(rows) if isinstance(rows, int) else rows
    return Feeder(q, Dataset(write_jsonl(tmp_path / name, data),
                             prompt_key=q.config.prompt_key))


def ids(leases: list[Lease]) -> list[str]:
    """The task ids of ``leases``, in order."""
    return [lease.task_id for lease in leases]


def tid(i: int) -> str:
    """The task id of dataset index ``i``."""
    return dataset_task_id(i)


def clobber(storage: Storage, key: str, data: bytes) -> None:
    """Replace a record's bytes, as a torn write or bit rot would leave them."""
    storage.delete(key)
    storage.publish(key, data)
