"""Two writers of the dataset cursor (docs/design.md, invariant 8): a CLI release beside a live
collector, a stalled collector beside its successor. Every interleaving must release each row once.

The cursor commit is a compare-and-swap on the release sequence number: a writer whose
knowledge is stale loses the commit, discards its staging and re-reads, so no row is
released twice (two live tasks with one id) and none is stranded in ``staging/``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from strawq.config import QueueConfig
from strawq.data.cursor import list_cursors
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.ondisk.names import dataset_task_id
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.queue import RunQueue
from strawq.testing import audit_run, make_group, write_jsonl
from strawq.testing.crash import drain
from strawq.testing.factories import prompts
from strawq.testing.faults import CrashPoint, FaultyStorage

N = 40


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "memory":
        return MemoryStorage()
    return PosixStorage(str(tmp_path / "run"), fsync=False)


def setup(storage: Storage, tmp_path: Path, rows: int = N,
          chunk: int = 1) -> tuple[RunQueue, Dataset]:
    q = RunQueue.create(storage, QueueConfig(release_batch=4, lease_timeout_s=10,
                                             heartbeat_interval_s=1, release_chunk=chunk))
    return q, Dataset(write_jsonl(tmp_path / "data.jsonl", prompts(rows)))


def check_once(storage: Storage, q: RunQueue, ds: Dataset, rows: int = N) -> None:
    """Nothing twice, nothing stranded: audit, then drain and count trained ids."""
    audit = audit_run(storage)
    assert audit.check({dataset_task_id(i) for i in range(audit.cursor_next)}) == []
    assert storage.list("staging") == [], "a committed range was stranded in staging/"
    trained = drain(storage, ds)
    ids = [t for batch in trained.values() for t in batch]
    assert len(ids) == len(set(ids)), "a row was trained twice"
    assert set(ids) == {dataset_task_id(i) for i in range(rows)}, "a row was lost"


def consume_all(q: RunQueue) -> None:
    """Producers drain every pending task (the release directory is removed)."""
    while leases := q.claim("p", 16):
        for lease in leases:
            q.complete(lease, make_group(lease.task_id, int(lease.task["index"])))
    q.list_pending()  # the drained release directories go


def test_cli_release_drained_before_collector_release_is_not_released_again(
        storage: Storage, tmp_path: Path) -> None:
    """Interleaving (a): the CLI's release is claimed and its directory removed before the
    collector's next release; the collector must not reuse the CLI's sequence number."""
    q, ds = setup(storage, tmp_path)
    collector = Feeder(q, ds)
    collector.release(4)
    cli = Feeder(RunQueue.open(storage), ds)  # `strawq release RUN DATASET --count 5`
    cli.release(5)
    consume_all(q)
    collector.release(4)
    consume_all(q)
    task_ids = [n.split("~")[1] for n in storage.list("ready")]
    assert len(task_ids) == len(set(task_ids)), f"a row was released twice: {task_ids}"
    assert sorted(task_ids) == [dataset_task_id(i) for i in range(13)]
    check_once(storage, q, ds)


def test_cli_release_still_pending_does_not_strand_the_collectors_rows(
        storage: Storage, tmp_path: Path) -> None:
    """Interleaving (b): the CLI's release directory still holds tasks when the collector
    releases; the collector's rows must be claimable, not stranded in staging/."""
    q, ds = setup(storage, tmp_path)
    collector = Feeder(q, ds)
    collector.release(4)
    Feeder(RunQueue.open(storage), ds).release(5)
    collector.release(4)
    assert storage.list("staging") == []
    assert collector.cursor.next_index == 13
    consume_all(q)
    check_once(storage, q, ds)


# Every interleaving of two writers' releases, at the granularity of storage operations:
# writer A runs until its k-th mutation, then B runs a whole release, then A finishes.
@pytest.mark.parametrize("a_first", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])  # 3: chunk directories in staging (range claims)
def test_every_interleaving_of_two_writers(tmp_path: Path, a_first: bool, chunk: int) -> None:
    seen = 0
    for k in itertools.count(1):
        storage = MemoryStorage()
        q, ds = setup(storage, tmp_path, chunk=chunk)
        a = Feeder(q, ds)
        b = Feeder(RunQueue.open(storage), ds)
        a.release(4)
        if a_first:
            b.release(4)  # b's view is now the newest; a's is stale
        faulty = FaultyStorage(storage, crash_after=k)
        a_mid = Feeder.__new__(Feeder)
        a_mid.__dict__.update(a.__dict__)
        a_mid.queue = RunQueue(faulty, q.config)
        a_mid.storage = faulty
        finished = False
        try:
            a_mid.release(4)
            finished = True
        except CrashPoint:
            # a paused (not dead) writer: b releases now, then a resumes on the real store
            b.release(4)
            a.release(4)
            b.release(4)
        consume_all(q)
        check_once(storage, q, ds)
        seen += 1
        if finished:
            break
    assert seen >= 3


def test_second_collector_after_takeover_cannot_release_on_stale_cursor(
        storage: Storage, tmp_path: Path) -> None:
    """A stalled collector wakes up after its successor released many times (its cursor's
    old records are garbage-collected): its commit must still lose."""
    q, ds = setup(storage, tmp_path)
    old = Feeder(q, ds)
    old.release(4)
    new = Feeder(RunQueue.open(storage), ds)
    for _ in range(6):
        new.release(4)
    assert min(seq for seq, _n, _k in list_cursors(storage)) > 2  # old ones GC'd
    old.release(4)
    assert old.cursor.next_index == 32  # it re-read and continued after the successor
    consume_all(q)
    check_once(storage, q, ds)


@pytest.mark.process
def test_concurrent_writers_in_processes(tmp_path: Path) -> None:
    """Several processes releasing at once on one POSIX run: each row exactly once."""
    import subprocess
    import sys
    root = str(tmp_path / "run")
    storage = PosixStorage(root)
    q, ds = setup(storage, tmp_path, rows=200)
    code = ("import sys\n"
            "from strawq.data.dataset import Dataset\nfrom strawq.data.feeder import Feeder\n"
            "from strawq.tasks.queue import RunQueue\nfrom strawq.storage import PosixStorage\n"
            "f = Feeder(RunQueue.open(PosixStorage(sys.argv[1], writer_id=sys.argv[3])), "
            "Dataset(sys.argv[2]))\n"
            "while f.release(3): pass\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, root, ds.url, f"w{i}"])
             for i in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    check_once(storage, q, ds, rows=200)
