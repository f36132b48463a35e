"""A failed part pauses nobody for longer than it takes to see it is dead.

Real processes: producers (``tests/collector/procs.py producer``) and collectors that are
``kill -9``-ed or ``SIGSTOP``-ped. No timed assertion: the lease (and takeover) timeouts are
600 s, so a test that finishes shows that nothing waited for them.

* a bracket does not wait for a producer whose process is gone (the same-host pid check),
  nor does a restarted trainer's first bracket, whose monitor has no history;
* a producer that is only stopped is not waited for once silent for the liveness timeout,
  keeps its leases (they expire after the lease timeout only), and on waking completes each
  of them once;
* a new collector takes over at once from a killed holder on this host, and after the
  liveness timeout from a stopped one, which finds itself fenced when it wakes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.errors import ConfigError
from strawq.ondisk.names import TaskName
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from strawq.testing.waiting import wait_until
from strawq.weights.control import Control
from tests.collector.helpers import make_run, write_dataset

REPO = Path(__file__).resolve().parents[2]
PROCS = str(Path(__file__).with_name("procs.py"))
LONG = 600.0  # the lease and takeover timeouts: a test that finishes did not wait for them
CFG = CollectorConfig(batch_groups=4, max_running=12, max_ready=4000,
                      max_prefetch_batches=1000, poll_interval_s=0, takeover_timeout_s=LONG)


class Fleet:
    """Producer subprocesses on one run, and an in-process collector stepped by waits."""

    def __init__(self, tmp: Path, **queue_kw: float) -> None:
        self.tmp = tmp
        self.run = str(tmp / "run")
        self.q = make_run(self.run, lease_timeout_s=LONG, **queue_kw)
        self.ds = Dataset(write_dataset(str(tmp / "ds.jsonl"), 4000))
        self.col = Collector(self.q, self.ds, CFG)
        self.col.start(wait=False)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def producer(self, name: str, seed: int) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, PROCS, "producer", self.run, name, "--seed", str(seed)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def started(self) -> None:
        """Wait until every producer beat before releasing work (none starts late, when
        the others took it all)."""
        wait_until(lambda: {p for p, _c in self.q.heartbeats()} >= set(self.procs), 60,
                   what="every producer's first heartbeat")

    def leases_of(self, name: str) -> set[str]:
        return {TaskName.parse(n).id for n in self.q.storage.list("leased")
                if TaskName.parse(n).producer == name}

    def step_until(self, cond: object, what: str) -> None:
        def check() -> bool:
            self.col.step()
            return bool(cond() if callable(cond) else cond)
        wait_until(check, 60, what=what)

    def kill9(self, name: str) -> None:
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()  # reaped: its pid is gone

    def stop_holding(self, name: str) -> set[str]:
        """SIGSTOP ``name`` at a moment it holds leases; returns them."""
        for _ in range(20):  # it may finish them just before the signal lands
            self.step_until(lambda: self.leases_of(name), f"{name} to hold leases")
            self.procs[name].send_signal(signal.SIGSTOP)
            held = self.leases_of(name)
            if held:
                return held
            self.procs[name].send_signal(signal.SIGCONT)
        raise AssertionError(f"{name} never held a lease when stopped")

    def close(self) -> None:
        Path(self.tmp / "stop-producers").touch()
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    made: list[Fleet] = []

    def make(**queue_kw: float) -> Fleet:
        made.append(Fleet(tmp_path, **queue_kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _bracket(f: Fleet, monitor: bool = True) -> WeightUpdateBracket:
    # the bracket's waits run the collector: it keeps releasing, and stays the grantor
    def sleep(dt: float) -> None:
        f.col.step()
        time.sleep(dt)
    return WeightUpdateBracket(f.q, monitor=f.col.monitor if monitor else None,
                               sleep=sleep, poll_interval_s=0.02)


@pytest.mark.process
@pytest.mark.timeout(90)
def test_bracket_does_not_wait_for_a_killed_producer(fleet_factory: Callable[..., Fleet]) -> None:
    # liveness = lease = 600 s (three heartbeats of 200 s): only the pid check can end it
    f = fleet_factory(heartbeat_interval_s=200.0)
    f.producer("live", 1)
    f.producer("dead", 2)
    f.started()
    f.step_until(lambda: f.leases_of("live"), "the live producer to hold leases")
    held = f.stop_holding("dead")
    f.kill9("dead")  # killed while holding leases
    rep = _bracket(f).weight_update(lambda v: None, timeout=LONG)
    assert rep.acked == {"live"} and set(rep.dead) == {"dead"}
    # its leases stay its own until the lease timeout: the grantor alone expires them
    f.col.step()
    assert f.leases_of("dead") == held


@pytest.mark.process
@pytest.mark.timeout(90)
def test_restarted_trainer_does_not_wait_for_a_producer_that_died_before_it(
        fleet_factory: Callable[..., Fleet]) -> None:
    f = fleet_factory(heartbeat_interval_s=200.0)
    f.producer("live", 1)
    f.producer("dead", 2)
    f.started()
    f.step_until(lambda: f.leases_of("dead"), "the producer to hold a lease")
    f.kill9("dead")
    # the previous trainer paused for version 1 and died inside the bracket
    Control(f.q.storage).pause(1)
    f.step_until(lambda: "live" in Control(f.q.storage).state().acks, "the live ack")
    # the restarted trainer: a new reader, whose bracket's monitor has no history
    reader = BatchReader(RunQueue.open(f.q.storage))
    assert reader.bracket.is_open
    rep = reader.bracket.weight_update(lambda v: None, timeout=LONG)
    assert rep.continued and rep.version == 1
    assert rep.acked == {"live"} and set(rep.dead) == {"dead"}


@pytest.mark.process
@pytest.mark.timeout(120)
def test_stopped_producer_is_not_waited_for_keeps_its_leases_and_completes_once(
        fleet_factory: Callable[..., Fleet]) -> None:
    # liveness: three heartbeats of 1 s (the sim producer beats every pass; at 0.3 s a
    # loaded 2-core machine let the live producer fall silent for 0.9 s too)
    f = fleet_factory(heartbeat_interval_s=1.0)
    f.producer("live", 1)
    f.producer("slow", 2)
    f.started()
    held = f.stop_holding("slow")
    rep = _bracket(f).weight_update(lambda v: None, timeout=LONG)
    assert rep.acked == {"live"} and set(rep.dead) == {"slow"}
    assert rep.dead["slow"] >= 3.0  # silent for the liveness timeout, not the lease's
    f.col.step()
    assert f.leases_of("slow") == held  # not expired: the lease timeout is 600 s
    f.procs["slow"].send_signal(signal.SIGCONT)
    # it wakes after the weight update, carries on, and completes each lease once
    f.step_until(lambda: not (f.leases_of("slow") & held),
                 "the woken producer to finish its leases")
    for tid in held:
        state, _name = f.q.find(tid)
        assert state in ("ready", "batched"), (tid, state)
    counts: dict[str, int] = {}
    for d in ("ready", "batched"):
        for n in f.q.storage.list(d):
            tid = TaskName.parse(n).id
            counts[tid] = counts.get(tid, 0) + 1
    assert all(counts.get(t) == 1 for t in held), counts


COLLECTOR = r"""
import sys
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from strawq.errors import FencedOut
col = Collector.open(sys.argv[1], Dataset(sys.argv[2]), CollectorConfig(
    batch_groups=4, max_running=8, max_ready=8, poll_interval_s=0.01,
    takeover_timeout_s=600.0), fsync=False, owner="old")
print("EPOCH", col.fence.epoch, flush=True)
try:
    col.run()
except FencedOut as exc:
    print("FENCED", exc, flush=True)
    sys.exit(3)
"""


def _collector_proc(run: str, ds: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", COLLECTOR, run, ds], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("EPOCH 1"), (line, p.stderr.read() if p.stderr else "")
    return p


@pytest.mark.process
@pytest.mark.timeout(90)
def test_collector_takeover_from_a_killed_holder_is_immediate(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = str(tmp_path / "run")
    make_run(run, lease_timeout_s=LONG, heartbeat_interval_s=200.0)  # liveness 600 s
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 40)
    old = _collector_proc(run, ds)
    old.kill()
    old.wait()  # reaped: its pid is gone
    q = RunQueue.open(open_storage(run, writer_id="new", fsync=False))
    new = Collector(q, Dataset(ds), CFG, owner="new")
    with caplog.at_level("INFO", logger="strawq.collector.fencing"):
        assert new.start() == 2  # without watching the 600 s takeover timeout
    # a restart after a crash is normal recovery: said at INFO, not as a warning or error
    taken = [r for r in caplog.records if "taking over without waiting" in r.getMessage()]
    assert [r.levelname for r in taken] == ["INFO"]


@pytest.mark.process
@pytest.mark.timeout(90)
def test_collector_takeover_from_a_killed_unreaped_holder_is_immediate(tmp_path: Path) -> None:
    """A holder killed with -9 that its parent has not reaped yet is a zombie: its pid still
    answers ``kill(pid, 0)``, but it can never write again, so it is dead (the takeover
    does not wait the 600 s takeover timeout)."""
    run = str(tmp_path / "run")
    make_run(run, lease_timeout_s=LONG, heartbeat_interval_s=200.0)  # liveness 600 s
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 40)
    old = _collector_proc(run, ds)
    try:
        old.kill()
        # not reaped: wait (without reaping) until the kernel shows it as a zombie
        wait_until(lambda: _state(old.pid) == "Z", timeout_s=30, what="the zombie state")
        q = RunQueue.open(open_storage(run, writer_id="new", fsync=False))
        new = Collector(q, Dataset(ds), CFG, owner="new")
        assert new.fence.holder_gone(1)
        assert new.start() == 2  # without watching the 600 s takeover timeout
        assert _state(old.pid) == "Z"  # judged dead while still a zombie, not reaped
    finally:
        old.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()[0].decode()


@pytest.mark.process
@pytest.mark.timeout(90)
def test_stopped_collector_is_not_judged_dead_and_is_fenced_after_the_takeover_timeout(
        tmp_path: Path) -> None:
    """A SIGSTOPped holder's pid exists: the fast path never takes over from it; the
    takeover timeout's silence does, and the woken holder is fenced out."""
    run = str(tmp_path / "run")
    make_run(run, lease_timeout_s=LONG, heartbeat_interval_s=0.2)  # liveness 0.6 s
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 40)
    old = _collector_proc(run, ds)
    try:
        old.send_signal(signal.SIGSTOP)
        q = RunQueue.open(open_storage(run, writer_id="new", fsync=False))
        quick = dataclasses.replace(CFG, takeover_timeout_s=1.0)
        new = Collector(q, Dataset(ds), quick, owner="new")
        assert not new.fence.holder_gone(1)
        assert new.start() == 2
        new.step()
        old.send_signal(signal.SIGCONT)
        out, _err = old.communicate(timeout=60)
        assert old.returncode == 3 and "FENCED" in out  # it stops acting on the run
        new.step()  # the live one carries on
    finally:
        if old.poll() is None:
            old.send_signal(signal.SIGCONT)
            old.kill()
            old.wait()


def test_liveness_timeout_is_checked_against_the_lease_timeout() -> None:
    assert QueueConfig(lease_timeout_s=60, heartbeat_interval_s=5).liveness_s == 15
    assert QueueConfig(lease_timeout_s=6, heartbeat_interval_s=5).liveness_s == 6
    assert QueueConfig(liveness_timeout_s=20).liveness_s == 20
    with pytest.raises(ConfigError, match="liveness_timeout_s .* at most lease_timeout_s"):
        QueueConfig(lease_timeout_s=10, heartbeat_interval_s=1, liveness_timeout_s=11)
    with pytest.raises(ConfigError, match="must be above heartbeat_interval_s"):
        QueueConfig(lease_timeout_s=10, heartbeat_interval_s=2, liveness_timeout_s=2)


BEAT_ONCE = r"""
import sys
from strawq.tasks.queue import RunQueue
from strawq.storage import open_storage
RunQueue.open(open_storage(sys.argv[1], writer_id="once", fsync=False)).heartbeat(sys.argv[2])
"""


@pytest.mark.process
@pytest.mark.timeout(60)
def test_heartbeat_names_its_process_and_a_reused_id_names_the_new_one(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    make_run(run, lease_timeout_s=LONG, heartbeat_interval_s=200.0)
    subprocess.run([sys.executable, "-c", BEAT_ONCE, run, "p"], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    q = RunQueue.open(open_storage(run, writer_id="here", fsync=False))
    # its process exited: a fresh bracket (no history) judges it dead at once
    assert WeightUpdateBracket(q).live_producers() == set()
    # the same id beaten by this process: the file now names this (live) process
    q.heartbeat("p")
    q.heartbeat("p")  # later beats are renames: they keep the body
    assert WeightUpdateBracket(q).live_producers() == {"p"}


@pytest.mark.timeout(60)
def test_an_idle_producer_is_not_waited_for_until_it_beats_unmarked(tmp_path: Path) -> None:
    """An idle heartbeat (``hb/<p>~<n>.idle``: no lease, claiming nothing) takes the
    producer out of a bracket's wait; its next plain beat, which it makes before reading
    ``control/`` and claiming, puts it back. The counter moves through both, so the grantor
    still sees it beat, and the idle file is the one the bracket reads and the grantor
    removes."""
    run = str(tmp_path / "run")
    make_run(run, lease_timeout_s=LONG, heartbeat_interval_s=200.0)
    q = RunQueue.open(open_storage(run, writer_id="here", fsync=False))
    q.heartbeat("p")
    bracket = WeightUpdateBracket(q)
    assert bracket.live_producers() == {"p"}
    q.heartbeat("p", idle=True)
    assert q.storage.list("hb") == ["p~0000000000000002.idle"]
    assert list(q.heartbeats()) == [("p", 2)]
    assert bracket.live_producers() == set()
    q.heartbeat("p")  # leaving idle: a rename, keeping the body (its process is named)
    assert q.storage.list("hb") == ["p~0000000000000003"]
    assert bracket.live_producers() == {"p"}
    # another process of the same producer id finds the idle file and beats on from it
    q.heartbeat("p", idle=True)
    again = RunQueue.open(open_storage(run, writer_id="again", fsync=False))
    assert again.heartbeat("p") == 5 and again.storage.list("hb") == ["p~0000000000000005"]
