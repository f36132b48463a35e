"""Crash points: simulated (every mutating step of every operation) and real (kill -9,
SIGSTOP/SIGCONT). After each crash the queue recovers and docs/design.md's invariants 1 and 2 must
hold: every released index in exactly one state, no torn record visible, nothing duplicated, and a
drain to the end trains every good row exactly once (Jepsen total-queue check)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery.batches import BatchStore
from strawq.delivery.retention import drop_totals
from strawq.errors import CorruptRecord, LeaseLost
from strawq.ondisk.names import data_key, dataset_task_id
from strawq.ondisk.records import decode
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing import audit_run, check_total_queue, make_group, write_jsonl
from strawq.testing.crash import drain, read_log, recover
from strawq.testing.factories import make_partial, prompts
from strawq.testing.faults import CrashPoint, FaultyStorage
from strawq.testing.waiting import wait_until

ROWS: list[Any] = [*prompts(5), "{not json", *prompts(4, start=6)]
BAD = dataset_task_id(5)
ALL = {dataset_task_id(i) for i in range(len(ROWS))}
REPO = Path(__file__).resolve().parents[2]


def tid(i: int) -> str:
    return dataset_task_id(i)


def check_recovered(storage: Storage, dataset: Dataset, *,
                    batches_before: dict[int, list[str]] | None = None,
                    acked_before: set[int] | None = None) -> None:
    """The invariants right after recovery, then after draining the queue to the end."""
    audit = audit_run(storage)
    released = {tid(i) for i in range(audit.cursor_next)}
    batches = dict(batches_before or {})
    batches.update(audit.manifests)
    trained = {t for seq in (acked_before or set()) | audit.acked
               for t in batches.get(seq, [])}
    problems = audit.check(released, trained=trained, extra_ok={BAD})
    assert problems == [], problems
    assert audit.ids("leased") == set(), "recovery must expire the dead holder's leases"
    if BAD in audit.entries:
        assert audit.state_of(BAD) == "dropped"

    batches.update(drain(storage, dataset))
    final = audit_run(storage)
    assert final.check(ALL, trained={t for ids in batches.values() for t in ids}) == []
    dropped = final.ids("dropped", "quarantined")
    assert BAD in dropped
    verdict = check_total_queue(ALL - dropped, [t for ids in batches.values() for t in ids])
    assert verdict.valid, verdict
    assert final.ids("pending", "partial", "leased", "ready") == set()
    assert_only_live_after_gc(storage)


#: Directories that hold nothing once every task was trained or dropped and gc ran.
WORK_DIRS = ("pending", "leased", "ready", "batched", "batches", "acked", "dropped", "data",
             "staging", "tmp")


def assert_only_live_after_gc(storage: Storage) -> None:
    """Invariant 6: after a drain and a plain gc only kept-on-purpose records remain."""
    totals = drop_totals(storage)
    BatchStore(RunQueue.open(storage)).gc(sweep=True, compact_drops_at=0)
    left = []
    for d in WORK_DIRS:
        for n in storage.list(d):
            key = f"{d}/{n}"
            left += [f"{key}/{m}" for m in storage.list(key)] if storage.is_dir(key) else [key]
    assert left == [], f"records left after a drain and gc: {left}"
    assert drop_totals(storage) == totals, "compaction changed the drop counts"


# -- deterministic crash-point enumeration (FaultyStorage(crash_after=N)) -------------------

@dataclass
class Ctx:
    q: RunQueue
    dataset: Dataset
    leases: list[Lease] = field(default_factory=list)
    batches: dict[int, list[str]] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    feeder: Feeder | None = None


def base(storage: Storage, path: str, chunk: int = 1) -> Ctx:
    q = RunQueue.create(storage, QueueConfig(max_attempts=2, lease_timeout_s=10,
                                             heartbeat_interval_s=1, release_batch=4,
                                             release_chunk=chunk,
                                             max_bad_row_share=1.0))  # a bad row on purpose
    ds = Dataset(path)
    Feeder(q, ds).release(4)
    return Ctx(q, ds)


def _claim(ctx: Ctx, n: int) -> Ctx:
    ctx.leases = ctx.q.claim("dead", n)
    return ctx


def _resumable(ctx: Ctx) -> Ctx:
    (lease,) = ctx.q.claim("p0", 1)
    ctx.q.yield_partial(lease, make_partial(lease.task_id, version=1))
    return _claim(ctx, 2)


def _at_max_attempts(ctx: Ctx) -> Ctx:
    (lease,) = ctx.q.claim("p0", 1)
    ctx.q.fail(lease, "boom")
    return _claim(ctx, 1)


def _ready(ctx: Ctx) -> Ctx:
    for lease in ctx.q.claim("p0", 3):
        ctx.q.complete(lease, make_group(lease.task_id, version=int(lease.task["index"])))
    return ctx


def _batched(ctx: Ctx, ack: bool) -> Ctx:
    _ready(ctx)
    bs = BatchStore(ctx.q)
    names = bs.scan_ready()[:2]
    bs.publish_batch(1, names)
    ctx.batches[1] = [n.id for n in names]
    if ack:
        bs.ack(1)
        ctx.acked.add(1)
    return ctx


def _expire(q: RunQueue, ctx: Ctx) -> None:
    clock = [0.0]
    mon = LeaseMonitor(q, clock=lambda: clock[0])
    mon.scan()
    clock[0] = 100.0
    mon.scan()


def _complete_resumed(q: RunQueue, ctx: Ctx) -> None:
    lease = ctx.leases[0]
    assert lease.has_partial
    q.complete(lease, make_group(lease.task_id, prefix=q.load_partial(lease)))


def _stale_feeder(ctx: Ctx) -> Ctx:
    """The collector's feeder, then a second writer (``strawq release``) moves the cursor."""
    ctx.feeder = Feeder(ctx.q, ctx.dataset)
    Feeder(RunQueue.open(ctx.q.storage), ctx.dataset).release(3)
    return ctx


def _stale_feeder_releases(q: RunQueue, ctx: Ctx) -> None:
    f = ctx.feeder
    assert f is not None
    f.queue, f.storage = q, q.storage  # the same object, now dying at storage step N
    f.release(4)


def _second_writer_mid_release(q: RunQueue, ctx: Ctx) -> None:
    """A second writer releases while the first is between its storage steps: the first
    runs on the faulty store; the interleaving point is its crash point."""
    f = ctx.feeder
    assert f is not None
    f.queue, f.storage = q, q.storage
    try:
        f.release(4)
    finally:
        Feeder(RunQueue.open(ctx.q.storage), ctx.dataset).release(2)


SCENARIOS: dict[str, tuple[Callable[[Ctx], Ctx], Callable[[RunQueue, Ctx], None]]] = {
    "stale_feeder_release": (_stale_feeder, _stale_feeder_releases),
    "second_writer_mid_release": (_stale_feeder, _second_writer_mid_release),
    "claim": (lambda c: c, lambda q, c: q.claim("dead", 3) and None),
    "heartbeat": (lambda c: (c.q.heartbeat("dead"), c)[1],
                  lambda q, c: q.heartbeat("dead") and None),
    "complete": (lambda c: _claim(c, 1),
                 lambda q, c: q.complete(c.leases[0], make_group(c.leases[0].task_id))
                 and None),
    "complete_resumed": (_resumable, _complete_resumed),
    "yield_partial": (lambda c: _claim(c, 1),
                      lambda q, c: q.yield_partial(c.leases[0],
                                                   make_partial(c.leases[0].task_id))
                      and None),
    "yield_again": (_resumable,
                    lambda q, c: q.yield_partial(c.leases[0], make_partial(
                        c.leases[0].task_id, prefix=q.load_partial(c.leases[0]))) and None),
    "release": (lambda c: _claim(c, 2), lambda q, c: q.release(c.leases[1]) and None),
    "fail_retry": (lambda c: _claim(c, 1),
                   lambda q, c: q.fail(c.leases[0], "engine_error", "x") and None),
    "fail_max_attempts": (_at_max_attempts,
                          lambda q, c: q.fail(c.leases[0], "engine_error", "x") and None),
    "drop": (lambda c: _claim(c, 1),
             lambda q, c: q.drop(c.leases[0], "filtered", "zero variance") and None),
    "feeder_release": (lambda c: c, lambda q, c: Feeder(q, c.dataset).release(4) and None),
    "feeder_release_to_end": (lambda c: (Feeder(c.q, c.dataset).release(4), c)[1],
                              lambda q, c: Feeder(q, c.dataset).release(8) and None),
    "expire": (lambda c: _claim(c, 3), _expire),
    "expire_max_attempts": (_at_max_attempts, _expire),
    "publish_batch": (_ready, lambda q, c: BatchStore(q).publish_batch(
        1, BatchStore(q).scan_ready()) and None),
    "ack": (lambda c: _batched(c, ack=False), lambda q, c: BatchStore(q).ack(1)),
    "gc": (lambda c: _batched(c, ack=True), lambda q, c: BatchStore(q).gc(full=True)
           and None),
    "requeue_ready": (_ready, lambda q, c: BatchStore(q).requeue_ready(
        BatchStore(q).scan_ready()[0]) and None),
    "drop_ready": (_ready, lambda q, c: BatchStore(q).drop_ready(
        BatchStore(q).scan_ready()[0], "too_stale") and None),
}


@pytest.mark.parametrize("backend", ["memory", "posix"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("chunk", [1, 3])  # 3: range claims (a claim of 3 takes a chunk)
def test_every_crash_point_recovers(scenario: str, backend: str, chunk: int,
                                    tmp_path: Path) -> None:
    setup, op = SCENARIOS[scenario]
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    crashes = 0
    for n in range(1, 200):
        inner: Storage = (MemoryStorage() if backend == "memory" else
                          PosixStorage(str(tmp_path / f"run{n}"), fsync=False))
        ctx = setup(base(inner, path, chunk))
        faulty = FaultyStorage(inner, crash_after=n)
        finished = False
        try:
            op(RunQueue(faulty, ctx.q.config), ctx)
            finished = True
        except CrashPoint:
            crashes += 1
        recover(inner, ctx.dataset, dead_writers=["w"])
        check_recovered(inner, ctx.dataset, batches_before=ctx.batches,
                        acked_before=ctx.acked)
        if finished:
            break
    else:  # pragma: no cover
        pytest.fail(f"{scenario} never completed")
    assert crashes >= 1, f"{scenario} made no mutation: the enumeration tested nothing"


def test_drop_reason_consistent_after_crash_before_drop(tmp_path: Path) -> None:
    inner = MemoryStorage()
    ctx = _at_max_attempts(base(inner, write_jsonl(tmp_path / "data.jsonl", ROWS)))
    note_publish = 1  # fail at max attempts: publish the drop note, then rename
    with pytest.raises(CrashPoint):
        RunQueue(FaultyStorage(inner, crash_after=note_publish + 1), ctx.q.config).fail(
            ctx.leases[0], "engine_error", "x")
    recover(inner, ctx.dataset)
    audit = audit_run(inner)
    assert audit.state_of(ctx.leases[0].task_id) == "dropped"
    assert audit.check({tid(i) for i in range(audit.cursor_next)}) == []


def test_gc_crash_leaves_no_orphan_ack(tmp_path: Path) -> None:
    inner = MemoryStorage()
    ctx = _batched(base(inner, write_jsonl(tmp_path / "data.jsonl", ROWS)), ack=True)
    faulty = FaultyStorage(inner, crash_after=10**6)
    BatchStore(RunQueue(faulty, ctx.q.config)).gc()
    deletes = [keys[0] for op, keys in faulty.log if op == "delete"]
    assert deletes[-1] == "acked/000000000001"  # the last step of gc
    inner2 = MemoryStorage()
    ctx2 = _batched(base(inner2, write_jsonl(tmp_path / "data2.jsonl", ROWS)), ack=True)
    with pytest.raises(CrashPoint):  # die right before deleting the ack marker
        BatchStore(RunQueue(FaultyStorage(inner2, crash_after=faulty.mutations),
                            ctx2.q.config)).gc()
    BatchStore(RunQueue.open(inner2)).gc()
    assert inner2.list("acked") == []


# -- real kill -9 ----------------------------------------------------------------------------

def _run_worker(root: str, data: str, log: str, kill_at: int, inside: bool) -> int:
    cmd = [sys.executable, "-m", "strawq.testing.crash", root, data, log,
           "--kill-at", str(kill_at)]
    if inside:
        cmd.append("--inside-publish")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          check=False)
    if proc.returncode not in (0, -signal.SIGKILL):
        pytest.fail(f"worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    if proc.returncode == 0:
        assert "COMPLETED" in proc.stdout
    return proc.returncode


def _torn(storage: Storage, keys: list[str]) -> list[str]:
    torn = []
    for key in keys:
        try:
            decode(storage.read(key))
        except CorruptRecord:
            torn.append(key)
    return torn


def _torn_in_staging(storage: Storage) -> list[str]:
    """Files in staging directories that are not whole records."""
    return _torn(storage, [f"staging/{d}/{f}" for d in storage.list("staging")
                           for f in storage.list(f"staging/{d}")])


def _torn_payloads(storage: Storage) -> list[str]:
    """Payloads in ``data/`` that are not whole records (a lease's payload is written in
    place: only its fencing rename commits it)."""
    return _torn(storage, [f"data/{n}" for n in storage.list("data")])


def _kill_matrix(tmp_path: Path, inside: bool) -> int:
    """Kill the worker at step 1, 2, ... until it completes; check every crash state.

    Children run a few at a time (they are independent: one run directory each); the
    parent then recovers and checks each state in order.
    """
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    kills = 0
    step = 4
    with ThreadPoolExecutor(step) as pool:
        for first in range(1, 400, step):
            runs = []
            for n in range(first, first + step):
                root, log = str(tmp_path / f"run{n}"), str(tmp_path / f"log{n}.jsonl")
                RunQueue.create(PosixStorage(root), QueueConfig(lease_timeout_s=10,
                                                               heartbeat_interval_s=1))
                runs.append((root, log, pool.submit(_run_worker, root, data, log, n, inside)))
            for root, log, fut in runs:
                rc = fut.result()
                if rc == 0:
                    return kills
                kills += 1
                storage = PosixStorage(root, writer_id="parent", fsync=False)
                if inside:
                    assert storage.list("tmp") or _torn_in_staging(storage) or \
                        _torn_payloads(storage), \
                        "a kill inside publish leaves its temp file (or, for a record " \
                        "written in place, a partial file in its staging directory or a " \
                        "partial payload)"
                batches, acked = read_log(log)
                recover(storage, Dataset(data), dead_writers=["victim"])
                assert storage.list("tmp") == [], "recovery removes the dead writer's temps"
                check_recovered(storage, Dataset(data), batches_before=batches,
                                acked_before=acked)
    pytest.fail("the worker never completed")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_before_each_mutation(tmp_path: Path) -> None:
    kills = _kill_matrix(tmp_path, inside=False)
    assert kills >= 40  # the worker's sequence makes 48 mutating steps


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_9_inside_publish_after_temp_file_written(tmp_path: Path) -> None:
    kills = _kill_matrix(tmp_path, inside=True)
    assert kills >= 20  # and 22 publishes


# -- SIGSTOP: a paused producer loses its lease and is fenced -------------------------------

PAUSED_PRODUCER = r"""
import os, sys, time
from strawq.errors import CorruptRecord, LeaseLost
from strawq.tasks.queue import RunQueue
from strawq.storage import PosixStorage
from strawq.testing import make_group

root, flag = sys.argv[1], sys.argv[2]
q = RunQueue.open(PosixStorage(root, writer_id="late"))
(lease,) = q.claim("late", 1)
print("CLAIMED", lease.name, flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(flag) and time.monotonic() < deadline:
    q.heartbeat("late")
    time.sleep(0.02)
try:
    q.complete(lease, make_group(lease.task_id, marker=-1.0))
except LeaseLost:
    print("LEASELOST", flush=True)
else:
    print("COMPLETED", flush=True)
"""


def _wait(check: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    wait_until(check, deadline_s, what=what)


@pytest.mark.process
@pytest.mark.timeout(120)
def test_sigstopped_producer_is_fenced_after_expiry(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    storage = PosixStorage(root, writer_id="grantor")
    q = RunQueue.create(storage, QueueConfig(lease_timeout_s=0.5, heartbeat_interval_s=0.1))
    Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", prompts(1)))).release(1)
    flag = str(tmp_path / "go")
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_PRODUCER, root, flag],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("CLAIMED"), (line, proc.stderr.read() if proc.stderr else "")
        mon = LeaseMonitor(q)  # the real monotonic clock, the 0.5 s lease timeout
        beats: list[int] = []

        def counter_moved() -> bool:
            res = mon.scan()
            assert res.expired == [], "the lease expired while its holder was beating"
            beats.append(res.producers.get("late", 0))
            return len(set(beats)) >= 3

        _wait(counter_moved, "the producer's heartbeat counter to move")
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = mon.scan().producers["late"]
        expired: list[str] = []

        def lease_expired() -> bool:
            res = mon.scan()
            assert res.producers["late"] <= stopped_at + 1, "a stopped process beat"
            expired.extend(res.expired)
            return bool(expired)

        _wait(lease_expired, "the stopped producer's lease to expire")
        assert expired == [tid(0)]
        (lease,) = q.claim("prompt", 1)
        assert lease.gen == 1
        q.complete(lease, make_group(lease.task_id, marker=1.0))
        Path(flag).touch()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "LEASELOST" in out and "COMPLETED" not in out
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    audit = audit_run(storage)
    assert audit.check({tid(0)}) == []
    assert audit.ids("ready") == {tid(0)} and audit.name_of(tid(0)).gen == 1
    assert audit.name_of(tid(0)).producer == "prompt"
    assert q.read_group(tid(0), 1).rewards == [1.0, 1.0]
    assert not storage.exists(data_key(tid(0), 0, "group")), "the late payload must go"
    with pytest.raises(LeaseLost):  # and stays fenced if it retries
        q.complete(Lease(lease.name.with_(gen=0, attempts=1, producer="late"), {}),
                   make_group(tid(0), marker=-1.0))
