"""Bounded storage: after a run and a plain ``gc`` the run directory holds live records only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery import retention
from strawq.delivery.batches import BatchStore
from strawq.ondisk.names import data_key, dataset_task_id
from strawq.storage import PosixStorage
from strawq.storage.posix import _host
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.tasks.turns import TURNS_DIR, TurnLog, turn_dir
from strawq.testing import make_group, write_jsonl
from strawq.testing.factories import make_partial, prompts
from strawq.views.inspect import describe_record
from strawq.views.status import run_status

#: directories that must be empty once every task was trained or dropped and gc ran
WORK_DIRS = ("pending", "leased", "ready", "batched", "batches", "acked", "dropped", "data",
             "staging", "tmp", "turns")


def _run(tmp_path: Path, rows: list[object], **cfg: object) -> tuple[RunQueue, Feeder]:
    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    q = RunQueue.create(storage, QueueConfig(fsync=False, lease_timeout_s=10.0,  # type: ignore
                                             heartbeat_interval_s=1.0, max_attempts=2,
                                             **cfg))
    feeder = Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", rows)))
    return q, feeder


def _train_everything(q: RunQueue) -> None:
    bs = BatchStore(q)
    names = bs.scan_ready()
    if names:
        seq = bs.next_seq()
        bs.publish_batch(seq, names)
        bs.ack(seq)


def _leftovers(q: RunQueue) -> dict[str, int]:
    files = retention.live_files(q.storage)
    return {d: files[d] for d in WORK_DIRS if files.get(d)}


def test_a_task_yielded_twice_leaves_nothing_once_trained(tmp_path: Path) -> None:
    q, feeder = _run(tmp_path, prompts(1))
    feeder.release(1)
    tid = dataset_task_id(0)
    for _ in range(2):
        (lease,) = q.claim("p")
        q.yield_partial(lease, make_partial(tid))
    (lease,) = q.claim("p")
    q.complete(lease, make_group(tid))
    _train_everything(q)
    assert cli_main(["gc", str(tmp_path / "run")]) == 0
    assert _leftovers(q) == {}


def test_every_way_out_is_collected_and_drops_stay_countable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows: list[object] = [*prompts(6), "{bad json"]
    q, feeder = _run(tmp_path, rows)
    feeder.release(7)  # row 6 is dropped as bad_row
    t = [dataset_task_id(i) for i in range(6)]
    leases = {lease.task_id: lease for lease in q.claim("p", 6)}
    q.yield_partial(leases[t[0]], make_partial(t[0]))               # partial, then trained
    q.drop(leases[t[1]], "zero_variance", "all rewards equal")      # dropped by a filter
    q.fail(leases[t[2]], "engine_error", "boom")                    # a fail note, retried
    q.complete(leases[t[3]], make_group(t[3]))                      # trained at once
    q.release(leases[t[4]])                                         # handed back untouched
    # t[5]'s holder goes silent: the lease expires and its late payload is fenced off
    clock = [0.0]
    mon = LeaseMonitor(q, lease_timeout_s=1.0, clock=lambda: clock[0])
    mon.scan()
    clock[0] = 5.0
    mon.scan()
    q.storage.publish(data_key(t[5], 0, "group"), make_group(t[5]).encode())  # the late write
    # second round: everything left completes, one more fails for good
    for lease in q.claim("p", 6):
        if lease.task_id == t[2]:
            q.fail(lease, "engine_error", "boom again")  # attempts exhausted: dropped
        else:
            q.complete(lease, make_group(lease.task_id))
    _train_everything(q)
    drops_before = run_status(q).dropped_by_reason
    assert drops_before == {"bad_row": 1, "engine_error.max_attempts": 1, "zero_variance": 1}

    assert cli_main(["gc", str(tmp_path / "run"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["drops_compacted"] == 3
    assert _leftovers(q) == {}
    # the audit: one segment, and the compacted drops' task records kept for requeue
    assert retention.live_files(q.storage)["audit"] == 2
    assert sorted(n.producer for _k, n in retention.kept_drops(q.storage)) == [
        "bad_row", "engine_error.max_attempts", "zero_variance"]
    # status and inspect still read the compacted drops
    assert run_status(q).dropped_by_reason == drops_before
    assert run_status(q).counts["dropped"] == 3
    shown = describe_record(q, t[1])
    assert shown["compacted"] and shown["meta"]["reason"] == "zero_variance"
    assert shown["meta"]["message"] == "all rewards equal"
    # a second gc finds nothing more, and counts do not double
    assert cli_main(["gc", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drops_compacted"] == 0
    assert run_status(q).dropped_by_reason == drops_before


def test_turn_checkpoints_left_by_a_killed_holder_go_once_no_task_can_resume_from_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A holder killed after its hand-back, before it deleted its turn checkpoints, leaves
    them behind: gc removes them once the task is trained, and keeps those of a task still
    leased (its holder's crash would resume from them) or dropped (``strawq requeue`` would),
    until its drop is compacted."""
    q, feeder = _run(tmp_path, prompts(3))
    feeder.release(3)
    t = [dataset_task_id(i) for i in range(3)]
    leases = {lease.task_id: lease for lease in q.claim("p", 3)}
    for tid in t:
        TurnLog(q.storage, leases[tid].name).save(make_partial(tid))
    q.complete(leases[t[0]], make_group(t[0]))  # killed here: no TurnLog.clear
    q.drop(leases[t[1]], "zero_variance", "all rewards equal")
    _train_everything(q)  # t[2] stays leased
    assert BatchStore(q).gc(sweep=True).turns == 1  # t[0]'s: trained
    assert q.storage.list(TURNS_DIR) == sorted([t[1], t[2]])
    # the CLI's gc compacts the drop into the audit (no requeue can reach it then)
    assert cli_main(["gc", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turn_checkpoints"] == 1
    assert q.storage.list(TURNS_DIR) == [t[2]]
    assert len(q.storage.list(turn_dir(t[2]))) == 1


def test_a_crash_between_audit_and_deletion_neither_loses_nor_double_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q, feeder = _run(tmp_path, prompts(3))
    feeder.release(3)
    for lease in q.claim("p", 3):
        q.drop(lease, "filtered", "x")
    real = retention._delete_dropped
    monkeypatch.setattr(retention, "_delete_dropped", lambda storage, names: None)
    assert retention.compact_drops(q.storage) == 3  # "crashed" before deleting
    assert retention.drop_totals(q.storage) == {"filtered": 3}
    monkeypatch.setattr(retention, "_delete_dropped", real)
    assert retention.compact_drops(q.storage) == 0
    assert q.storage.list("dropped") == []
    assert retention.drop_totals(q.storage) == {"filtered": 3}


def test_audit_segments_are_merged_and_counts_stay_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retention, "MAX_SEGMENTS", 3)
    monkeypatch.setattr(retention, "KEEP_DETAILS", 4)
    q, feeder = _run(tmp_path, prompts(10), release_batch=10)
    feeder.release(10)
    for lease in q.claim("p", 10):
        q.drop(lease, "filtered", "x")
        retention.compact_drops(q.storage)
    assert len(q.storage.list("audit")) <= 3
    assert retention.drop_totals(q.storage) == {"filtered": 10}
    assert retention.find_drop(q.storage, dataset_task_id(9)) is not None


@pytest.mark.process
def test_temporary_files_of_dead_writers_go_without_naming_them(tmp_path: Path) -> None:
    q, _feeder = _run(tmp_path, prompts(1))
    tmp = tmp_path / "run" / "tmp"
    tmp.mkdir(exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    mine = tmp / f"victim.{_host()}-{dead}.0123abcd"           # this host, dead pid
    old = tmp / "p-other.otherhost-42.4567"                     # another host, abandoned
    fresh = tmp / "p-other.otherhost-43.89ab"                   # another host, in flight
    for f in (mine, old, fresh):
        f.write_bytes(b"partial write")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert cli_main(["gc", str(tmp_path / "run")]) == 0
    assert sorted(os.listdir(tmp)) == [fresh.name]


def test_publish_names_its_temporary_file_after_host_and_pid(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path / "s"), writer_id="w1", fsync=False)
    assert not (tmp_path / "s" / "tmp").exists()  # opening writes nothing
    seen: list[str] = []
    real = os.rename

    def spy(src: str, dst: str, **kw: Any) -> None:
        seen.append(os.path.basename(src))
        real(src, dst, **kw)

    import strawq.storage.posix as posix

    posix._renameat2, saved = None, posix._renameat2
    storage._noreplace_ok = False
    try:
        os.rename = spy  # type: ignore[assignment]
        storage.publish("a/b", b"x")
    finally:
        os.rename = real  # type: ignore[assignment]
        posix._renameat2 = saved
    assert seen and seen[0].startswith(f"w1.{_host()}-{os.getpid()}.")


def test_the_run_audit_accounts_for_compacted_drops(tmp_path: Path) -> None:
    """A drop folded into the drop audit has no entry left: the run audit (invariant 1)
    finds it in the history, with its reason, instead of calling it lost."""
    from strawq.testing.audit import audit_run

    q, feeder = _run(tmp_path, prompts(3))
    feeder.release(3)
    for lease in q.claim("p", 3):
        q.drop(lease, "filtered", "x")
    assert retention.compact_drops(q.storage) == 3 and q.storage.list("dropped") == []
    released = [dataset_task_id(i) for i in range(3)]
    assert audit_run(q.storage).check(released) == []
    # a task with neither an entry nor a recorded attempt is still lost
    assert audit_run(q.storage).check([*released, dataset_task_id(3)]) == [
        f"lost: {dataset_task_id(3)} is in no state"]
