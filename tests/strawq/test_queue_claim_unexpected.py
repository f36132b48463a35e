"""A producer meeting a state it does not expect logs it and skips the task; it never exits.

The state here is the one a cursor written by two writers used to leave: one task id live
twice (two release directories hold the same fresh task). The second claim's rename finds
its destination taken; the claim skips it and moves the duplicate aside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.queue import RunQueue
from strawq.testing import write_jsonl
from strawq.testing.factories import prompts


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "memory":
        return MemoryStorage()
    return PosixStorage(str(tmp_path / "run"), fsync=False)


def test_claim_skips_a_duplicate_task_instead_of_raising(storage: Storage,
                                                         tmp_path: Path) -> None:
    q = RunQueue.create(storage, QueueConfig(release_batch=2))
    Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", prompts(2)))).release(2)
    (rdir,) = [d for d in storage.list("pending") if d.startswith("r-")]
    first = storage.list(f"pending/{rdir}")[0]
    # the same fresh task a second time, in another release directory
    storage.publish(f"pending/r-000000000099/{first}", storage.read(f"pending/{rdir}/{first}"))
    got = q.claim("p", 1)
    assert [lease.name.id for lease in got] == [first.split("~")[1]]
    again = q.claim("p", 2)  # meets the duplicate: skipped, the other task is claimed
    assert [lease.task["index"] for lease in again] == [1]
    assert any(first in n for n in storage.list("quarantine")), storage.list("quarantine")
    assert q.claim("p", 2) == []
