"""A full disk under the collector and the trainer: the collector says so and waits, the
trainer's acks still go through, and the run finishes by itself once space returns, every
group trained exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BatchTimeout, RunFinished
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from strawq.testing.waiting import wait_until
from strawq.views.status import run_status
from tests.collector.helpers import SimProducer, make_run, write_dataset
from tests.small_disk import SmallDisk, small_disk  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)


@pytest.mark.process
def test_a_full_disk_pauses_the_collector_and_the_run_resumes_when_space_returns(
        small_disk: SmallDisk, tmp_path: Path) -> None:  # noqa: F811
    n = 8
    run = os.path.join(small_disk.path, "run")
    q = make_run(run, release_batch=n)
    data = write_dataset(str(tmp_path / "data.jsonl"), n)
    col = Collector(q, Dataset(data), CollectorConfig(
        batch_groups=2, max_staleness=None, max_running=n, max_ready=n,
        max_prefetch_batches=1, poll_interval_s=0.01, gc_interval_s=1000))
    col.start(wait=False)
    col.step()  # releases all n
    producer = SimProducer(RunQueue.open(open_storage(run, writer_id="p0", fsync=False)), "p0")
    for _ in range(500):
        if len(q.storage.list("ready")) == n:
            break
        producer.step()
    col.step()  # publishes batch 0
    reader = BatchReader(RunQueue.open(open_storage(run, writer_id="trainer", fsync=False)))
    trained: list[int] = []
    first = reader.next_batch(timeout=5)

    small_disk.fill()
    # the trainer's ack and commit are names only: they go through on the full disk
    trained += [s["index"] for s in first.summaries]
    reader.ack(first)
    reader.commit(reader.state_dict(consumed=first))
    failed: list[BaseException] = []

    def collect() -> None:
        try:
            col.run(until_drained=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failed.append(exc)

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    try:
        wait_until(lambda: getattr(col, "storage_full", None) is not None
                   or not thread.is_alive(), 20,
                   what="the collector to meet the full disk")
        assert thread.is_alive(), f"the collector stopped on a full disk: {failed}"
        message = col.storage_full or ""
        assert run in message and "is full" in message and f"strawq gc {run}" in message
        status = run_status(RunQueue.open(open_storage(run, read_only=True)))
        assert status.disk["full"] and status.disk["path"] == run
        cli = subprocess.run([sys.executable, "-m", "strawq", "status", run],
                             capture_output=True, text=True, timeout=30, check=False)
        assert cli.returncode == 0, cli.stderr
        line = [ln for ln in cli.stdout.splitlines() if "disk full" in ln]
        assert len(line) == 1 and f"strawq gc {run}" in line[0], cli.stdout
        assert thread.is_alive()

        small_disk.free()
        while thread.is_alive():
            try:
                batch = reader.next_batch(timeout=0.5)
            except BatchTimeout:
                continue
            except RunFinished:  # the last checkpoint: the finished collector waits for it
                reader.commit(reader.state_dict())
                break
            trained += [s["index"] for s in batch.summaries]
            reader.ack(batch)
    finally:
        thread.join(timeout=10)
        reader.close()
    assert not failed, failed
    assert sorted(trained) == list(range(n))
    assert col.storage_full is None
    assert not q.storage.list("dropped") and q.storage.list("tmp") == []
    status = run_status(RunQueue.open(open_storage(run, read_only=True)))
    assert not status.disk["full"]


@pytest.mark.process
def test_a_release_refused_on_a_nearly_full_disk_leaves_nothing_staged_and_warns_early(
        small_disk: SmallDisk, tmp_path: Path) -> None:  # noqa: F811
    from strawq.data.feeder import Feeder
    from strawq.errors import StorageFull
    from strawq.views.status import disk_space

    run = os.path.join(small_disk.path, "run")
    q = make_run(run, release_batch=64)
    rows = str(tmp_path / "data.jsonl")
    with open(rows, "w", encoding="utf-8") as f:  # ~2 KiB task records
        for i in range(64):
            f.write(json.dumps({"prompt": list(range(i, i + 400)), "i": i}) + "\n")
    assert disk_space(q.storage)["low"] is False  # a fresh 2 MiB volume: room to act
    small_disk.fill()
    small_disk.shrink_ballast(16 * 1024)  # room for a few task records, not 64
    assert disk_space(q.storage)["low"]
    free_before = small_disk.free_bytes()
    with pytest.raises(StorageFull):
        Feeder(q, Dataset(rows)).release(64)
    assert q.storage.list("staging") == []  # what it had staged is gone
    assert small_disk.free_bytes() >= free_before - 8 * 1024
    small_disk.free()
    assert Feeder(q, Dataset(rows)).release(64) == 64  # nothing was lost either
