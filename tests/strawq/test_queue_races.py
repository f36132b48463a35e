"""Multi-process races on one queue: every task is won exactly once (huey's
``test_put_if_empty_concurrent``, Jepsen's total-queue checker), on a local directory and
across two JuiceFS clients; and expiry (grantor) against complete (holder)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.errors import LeaseLost, StrawqError
from strawq.ondisk.names import TaskName, data_key, dataset_task_id
from strawq.storage import PosixStorage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import Lease, RunQueue
from strawq.testing import audit_run, check_total_queue, make_group, write_jsonl
from strawq.testing.factories import make_partial, prompts

pytestmark = pytest.mark.slow

PROCESSES = 8
TASKS = 400
DEADLINE_S = 120.0

ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                  else "spawn")


def _start(procs: list[Any]) -> None:
    # Collect garbage before forking: a child must not inherit half-dead objects (earlier
    # rounds' processes and pipes) whose finalizers would close descriptor numbers that the
    # child has meanwhile reused for its own files (seen as EBADF from fsync/close).
    gc.collect()
    for p in procs:
        p.start()


def _finish(procs: list[Any], out: Any) -> list[int | None]:
    for p in procs:
        p.join(DEADLINE_S)
        if p.is_alive():
            p.kill()
            p.join(DEADLINE_S)
    codes = [p.exitcode for p in procs]
    for p in procs:
        p.close()
    out.close()
    out.join_thread()
    return codes


def _claimer(root: str, me: int, barrier: Any, out: Any) -> None:
    try:
        q = RunQueue.open(PosixStorage(root, writer_id=f"c{me}"))
        won: list[tuple[str, int]] = []
        barrier.wait(DEADLINE_S)
        while True:
            leases = q.claim(f"p{me}", 1 + me % 3)
            if not leases:
                if not q.list_pending():
                    break
                continue
            for lease in leases:
                prefix = q.load_partial(lease)
                q.complete(lease, make_group(lease.task_id, int(lease.task["index"]),
                                             prefix=prefix, marker=float(me)))
                won.append((lease.task_id, lease.gen))
        out.put((me, won, None))
    except BaseException:  # noqa: BLE001 - the parent fails the test with it
        out.put((me, [], traceback.format_exc()))


def _prepare(root: str, tmp_path: Path) -> dict[str, int]:
    """TASKS fresh tasks over several releases, plus partial and returned ones."""
    q = RunQueue.create(PosixStorage(root), QueueConfig(release_batch=40))
    feeder = Feeder(q, Dataset(write_jsonl(tmp_path / "data.jsonl", prompts(TASKS))))
    while feeder.release():
        pass
    expected_gen = {dataset_task_id(i): 0 for i in range(TASKS)}
    leases = q.claim("setup", 20)
    for i, lease in enumerate(leases):
        if i % 2:
            q.yield_partial(lease, make_partial(lease.task_id, version=i))
        else:
            q.release(lease)
        expected_gen[lease.task_id] = 1
    return expected_gen


def _race(roots: list[str], run_root: str, expected_gen: dict[str, int]) -> None:
    barrier = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(roots[i % len(roots)], i, barrier, out))
             for i in range(PROCESSES)]
    _start(procs)
    results: dict[int, list[tuple[str, int]]] = {}
    errors = []
    try:
        while len(results) + len(errors) < PROCESSES:
            me, won, err = out.get(timeout=DEADLINE_S)
            if err:
                errors.append(err)
            else:
                results[me] = won
    finally:
        exitcodes = _finish(procs, out)
    assert not errors, "\n".join(errors)
    assert exitcodes == [0] * PROCESSES

    dequeued = [tid for won in results.values() for tid, _gen in won]
    verdict = check_total_queue(expected_gen, dequeued)
    assert verdict.valid, verdict
    winner = {tid: me for me, won in results.items() for tid, _ in won}
    for won in results.values():
        for tid, gen in won:
            assert gen == expected_gen[tid], f"{tid} won at generation {gen}"

    storage = PosixStorage(run_root, writer_id="checker")
    audit = audit_run(storage)
    assert audit.check(expected_gen) == []
    assert audit.ids("ready") == set(expected_gen)
    assert audit.counts()["ready"] == TASKS
    q = RunQueue.open(storage)
    for tid in expected_gen:  # the payload in ready is the winner's
        name = audit.name_of(tid)
        assert name.producer == f"p{winner[tid]}"
        assert q.read_group(tid, name.gen).rewards[0] == float(winner[tid])
    assert sum(1 for n in Counter(winner.values()).values() if n) >= 2, \
        "only one process won anything: the race did not race"


@pytest.mark.timeout(240)
def test_claim_race_local_directory(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    expected = _prepare(root, tmp_path)
    _race([root], root, expected)


@pytest.mark.juicefs
@pytest.mark.timeout(300)
def test_claim_race_across_two_juicefs_clients(juicefs_engine_dirs: tuple[str, str],
                                               tmp_path: Path) -> None:
    a, b = (os.path.join(d, "run") for d in juicefs_engine_dirs)
    expected = _prepare(a, tmp_path)
    _race([a, b], a, expected)


# -- expiry (grantor) against complete (holder) ---------------------------------------------

def _completer(root: str, name: str, barrier: Any, out: Any) -> None:
    try:
        q = RunQueue.open(PosixStorage(root, writer_id="holder"))
        lease = Lease(TaskName.parse(name), {})
        group = make_group(lease.task_id, marker=7.0)
        barrier.wait(DEADLINE_S)
        try:
            q.complete(lease, group)
        except LeaseLost:
            out.put(("holder", "lost"))
        except StrawqError as exc:  # any other error is a bug: the contract is LeaseLost
            out.put(("holder", f"error:{type(exc).__name__}: {exc}"))
        else:
            out.put(("holder", "won"))
    except BaseException:  # noqa: BLE001
        out.put(("holder", traceback.format_exc()))


def _expirer(root: str, barrier: Any, out: Any, delay_s: float) -> None:
    try:
        q = RunQueue.open(PosixStorage(root, writer_id="grantor"))
        clock = [0.0]
        mon = LeaseMonitor(q, clock=lambda: clock[0])
        mon.scan()
        clock[0] = 1e6
        barrier.wait(DEADLINE_S)
        time.sleep(delay_s)  # spread the start so both sides win some rounds
        res = mon.scan()
        out.put(("grantor", "won" if res.expired else "lost"))
    except BaseException:  # noqa: BLE001
        out.put(("grantor", traceback.format_exc()))


def _expiry_race(root_holder: str, root_grantor: str, tmp_path: Path, rounds: int) -> None:
    q = RunQueue.create(PosixStorage(root_holder), QueueConfig(release_batch=rounds))
    Feeder(q, Dataset(write_jsonl(tmp_path / "data.jsonl", prompts(rounds)))).release()
    outcomes: Counter[str] = Counter()
    for r in range(rounds):
        (lease,) = q.claim("holder", 1)
        barrier = ctx.Barrier(2)
        out = ctx.Queue()
        procs = [ctx.Process(target=_completer, args=(root_holder, str(lease.name), barrier,
                                                      out)),
                 ctx.Process(target=_expirer, args=(root_grantor, barrier, out,
                                                    (r % 5) * 0.002))]
        _start(procs)
        got = dict(out.get(timeout=DEADLINE_S) for _ in procs)
        _finish(procs, out)
        assert {v.split(":")[0] for v in got.values()} == {"won", "lost"}, f"round {r}: {got}"
        assert "Traceback" not in got["holder"], got["holder"]
        state, name = q.find(lease.task_id)
        if got["holder"] == "won":
            assert (state, name.gen) == ("ready", 0)
            assert q.read_group(lease.task_id, 0).rewards == [7.0, 7.0]
        else:
            assert (state, name.gen, name.attempts) == ("pending", 1, 1)
            assert not q.storage.exists(data_key(lease.task_id, 0, "group"))
            # returned tasks come first to a claimer that lists the top of pending/: a
            # new handle's does (q's own lists it again only TOP_LIST_INTERVAL_S after
            # its last claim, and a round can take less)
            (again,) = RunQueue.open(q.storage).claim("finisher", 1)
            assert (again.task_id, again.gen) == (lease.task_id, 1)
            q.complete(again, make_group(again.task_id, marker=1.0))
        outcomes[got["holder"]] += 1
        if got["holder"].startswith("lost"):
            got["holder"] = "lost"
    ids = [dataset_task_id(i) for i in range(rounds)]
    assert audit_run(q.storage).check(ids) == []
    assert sum(outcomes.values()) == rounds
    print(f"expiry race outcomes (holder): {dict(outcomes)}")


@pytest.mark.timeout(180)
def test_expiry_vs_complete_one_winner_local(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    _expiry_race(root, root, tmp_path, rounds=20)


@pytest.mark.juicefs
@pytest.mark.timeout(240)
def test_expiry_vs_complete_one_winner_across_juicefs(juicefs_engine_dirs: tuple[str, str],
                                                      tmp_path: Path) -> None:
    a, b = (os.path.join(d, "run") for d in juicefs_engine_dirs)
    _expiry_race(a, b, tmp_path, rounds=12)
