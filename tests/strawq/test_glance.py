"""``strawq status`` at a glance: liveness from heartbeat counters, the open bracket, stalls.

``test_a_stalled_bracket_and_a_dead_producer_read_as_in_the_docs`` builds the state that
docs/operations.md shows (a bracket open for 12 minutes, one producer whose process died 9
minutes ago without acking it, one live producer that acked, a live collector) and checks that
the doc's text is what status prints for it, line for line (the disk line aside).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from strawq.app import cli
from strawq.collector.fencing import EpochFence
from strawq.config import QueueConfig
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from strawq.views import glance as glance_mod
from strawq.views.glance import Watcher, glance
from strawq.views.glance_text import render
from strawq.weights.control import Control
from tests.strawq.queue_helpers import FakeClock, make_feeder

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
SHOWN_PATH = "/runs/exp1"

_CHILD = textwrap.dedent("""
    import sys
    from strawq.tasks.queue import RunQueue
    from strawq.storage import open_storage
    q = RunQueue.open(open_storage(sys.argv[1], writer_id="p-3", fsync=False))
    q.heartbeat("p-3")
    print("beat", flush=True)
    sys.stdin.readline()
    q.heartbeat("p-3")
""")


def _run(tmp_path: Path, **cfg: Any) -> RunQueue:
    kw: dict[str, Any] = {"fsync": False, "lease_timeout_s": 60.0, "heartbeat_interval_s": 5.0}
    kw.update(cfg)
    return RunQueue.create(open_storage(str(tmp_path / "run"), writer_id="setup", fsync=False),
                           QueueConfig(**kw))


def stalled_run(tmp_path: Path) -> tuple[RunQueue, Watcher, FakeClock]:
    """A run whose weight-update bracket has been open for 12 minutes: p-1 (this process)
    acked it; p-3 died 9 minutes ago (its process is gone, so it never
    acks); the collector (this process) beats. The watcher saw p-3 beat once, then die."""
    q = _run(tmp_path)
    make_feeder(q, tmp_path, 8).release(8)
    fence = EpochFence(q.storage, owner="collector")
    fence.acquire(wait=False)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "run")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "beat"
    q.heartbeat("p-1")
    Control(q.storage).pause(1)
    Control(q.storage).ack(1, "p-1")
    clock = FakeClock()
    w = Watcher(q.storage, clock=clock)
    w.look()                                   # p-3 at its first beat
    clock.advance(1.0)
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.wait(30) == 0                 # p-3 beat once more and its process ended
    q.heartbeat("p-1")
    fence.beat()
    w.look()                                   # p-3 seen to move, now gone
    clock.advance(538.5)                       # nine minutes after its last beat
    q.heartbeat("p-1")
    fence.beat()
    w.look()
    clock.advance(1.5)
    return q, w, clock


def _text(q: RunQueue, w: Watcher) -> str:
    # the bracket's age is read from its pause record (the trainer's clock): 12 minutes on
    return render(glance(q, SHOWN_PATH, w, wall=lambda: time.time() + 725.0))


def _doc_block() -> list[str]:
    text = DOC.read_text()
    m = re.search(r"```text\n(run /runs/exp1 .*?)```", text, re.S)
    assert m, "docs/operations.md has no status example for /runs/exp1"
    return m.group(1).rstrip("\n").splitlines()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_stalled_bracket_and_a_dead_producer_read_as_in_the_docs(tmp_path: Path) -> None:
    q, w, _clock = stalled_run(tmp_path)
    lines = _text(q, w).splitlines()
    assert "  STALLED: bracket for version 1 open 12m, waiting for p-3 (dead 9m, process " \
           "gone)" in lines
    assert "    p-3  dead 9m, process gone, 0 leases" in lines
    assert "    p-1  live, beat 1.5s ago, 0 leases" in lines
    assert "  collector: live, beat 1.5s ago, epoch 1" in lines
    assert "  trainer:   unknown" in lines
    assert not any("{" in line for line in lines)  # words, not Python structures
    doc = _doc_block()
    ours = [x for x in lines if not x.startswith("  disk:")]
    theirs = [x for x in doc if not x.startswith("  disk:")]
    assert ours == theirs, "docs/operations.md's status example drifted from what status prints"


def test_liveness_is_judged_from_counters_on_our_clock(tmp_path: Path) -> None:
    q = _run(tmp_path, lease_timeout_s=10.0, heartbeat_interval_s=1.0)
    clock = FakeClock()
    w = Watcher(q.storage, clock=clock)
    q.heartbeat("busy")
    q.heartbeat("quiet")
    q.heartbeat("rest", idle=True)
    w.look()
    clock.advance(0.5)
    q.heartbeat("busy")
    w.look()
    limits = {"lease_s": 10.0, "liveness_s": 3.0, "interval_s": 1.0}
    judged = {p: glance_mod.judge(w, p, **limits)[0] for p in ("busy", "quiet", "rest")}
    assert judged == {"busy": "live", "quiet": "unknown", "rest": "idle"}
    clock.advance(2.0)
    assert glance_mod.judge(w, "quiet", **limits)[0] == "silent"
    assert glance_mod.judge(w, "busy", **limits)[0] == "live"
    clock.advance(9.0)
    judged = {p: glance_mod.judge(w, p, **limits)[0] for p in ("busy", "quiet", "rest")}
    assert judged == {"busy": "dead", "quiet": "dead", "rest": "dead"}


def test_no_live_producer_a_dead_collector_and_a_full_disk_are_stalls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q = _run(tmp_path, lease_timeout_s=10.0, heartbeat_interval_s=1.0)
    make_feeder(q, tmp_path, 4).release(4)
    fence = EpochFence(q.storage, owner="collector")
    fence.acquire(wait=False)
    q.heartbeat("p-1")
    clock = FakeClock()
    w = Watcher(q.storage, clock=clock)
    w.look()
    clock.advance(30.0)  # nobody beat for 30s: past the 10s lease timeout
    monkeypatch.setattr("strawq.views.status.disk_space", lambda _st: {
        "path": "/x", "free_bytes": 3 * 2**30, "total_bytes": 100 * 2**30,
        "free_ratio": 0.03, "free_inodes": 10, "full": False})
    g = glance(q, "run", w)
    assert g.stalls == ["no live producer (1 dead)", "collector dead, no beat seen in 30s",
                        "disk 97% full (3.0 GiB free)"]
    assert "  disk:      3.0 GiB free (3% of the volume)" in render(g).splitlines()


def test_status_json_has_liveness_bracket_and_stalls(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = _run(tmp_path)
    q.heartbeat("p-1")
    Control(q.storage).pause(3)
    assert cli.main(["status", str(tmp_path / "run"), "--json", "--sample", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["producers"]["p-1"]["state"] == "unknown"
    assert out["bracket"]["open"] and out["bracket"]["version"] == 3
    assert list(out["bracket"]["waiting"]) == ["p-1"]
    assert out["bracket"]["waiting"]["p-1"].startswith("unknown, no beat seen in ")
    assert out["collector"] == {"epoch": 0, "state": "none"}
    assert out["trainer"] == {"state": "unknown"}
    assert "no collector has run on this run" in out["stalls"]
    assert out["counts"]["pending"] == 0 and 0 < out["disk"]["free_ratio"] <= 1


def test_status_on_a_folder_of_runs_lists_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        RunQueue.create(open_storage(str(tmp_path / "runs" / name), writer_id="setup",
                                     fsync=False), QueueConfig(fsync=False))
    Control(open_storage(str(tmp_path / "runs" / "b"), writer_id="t", fsync=False)).pause(2)
    assert cli.main(["status", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "is not a run; 2 run(s) under it" in out
    assert re.search(r"^  a  weight version 0; pending 0", out, re.M)
    assert re.search(r"^  b  .*; bracket open for version 2$", out, re.M)
    assert "strawq init" not in out
    assert cli.main(["status", str(tmp_path / "runs"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert [Path(r["path"]).name for r in rows] == ["a", "b"]


def test_watch_redraws_until_ctrl_c_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    naps: list[float] = []

    def nap(s: float) -> None:
        naps.append(s)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("strawq.views.glance_text.time.sleep", nap)
    assert cli.main(["status", str(tmp_path / "run"), "--watch", "0.5", "--sample", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("(weight version") == 2 and naps == [0.5, 0.5]
    assert "Traceback" not in captured.err and "interrupted" not in captured.err


def test_a_look_watches_until_every_party_beat_or_the_window_ends(tmp_path: Path) -> None:
    q = _run(tmp_path, lease_timeout_s=10.0, heartbeat_interval_s=1.0)
    q.heartbeat("busy")
    q.heartbeat("rest", idle=True)  # idle: not waited for
    clock = FakeClock()
    naps: list[float] = []

    def nap(s: float) -> None:
        naps.append(s)
        clock.advance(s)
        if len(naps) == 3:
            q.heartbeat("busy")

    w = Watcher(q.storage, clock=clock, sleep=nap)
    w.watch(5.0)
    assert len(naps) == 3 and w.age("busy") == (0.0, True)  # stopped at busy's beat
    q.heartbeat("stuck")
    w2 = Watcher(q.storage, clock=clock, sleep=lambda s: clock.advance(s))
    start = clock.t
    w2.watch(2.0)
    assert clock.t - start == pytest.approx(2.0)  # "stuck" never beat: the whole window
    assert glance_mod.judge(w2, "stuck", lease_s=10.0, liveness_s=3.0, interval_s=1.0)[0] \
        == "silent"


def test_the_trainer_line_names_the_trainer_fences_holder(tmp_path: Path) -> None:
    from strawq.collector.trainer.fence import TrainerFence

    q = _run(tmp_path)
    w = Watcher(q.storage, clock=FakeClock())
    assert "  trainer:   unknown" in render(glance(q, "run", w)).splitlines()
    fence = TrainerFence(q.storage, beat_interval_s=None)
    fence.acquire(wait=False)
    g = glance(q, "run", w)
    line = [x for x in render(g).splitlines() if x.startswith("  trainer:")]
    assert line and line[0].startswith("  trainer:   holding (trainer epoch 1: host ")
    assert g.to_dict()["trainer"]["epoch"] == 1 and g.to_dict()["trainer"]["pid"] == os.getpid()


def test_a_finished_run_is_not_stalled(tmp_path: Path) -> None:
    from strawq.tasks.finished import mark_finished

    q = _run(tmp_path)
    q.heartbeat("p-1")
    w = Watcher(q.storage, clock=FakeClock())
    assert glance(q, "run", w).stalls  # no collector, a silent producer
    mark_finished(q.storage, 7, 1)
    g = glance(q, "run", w)
    assert g.stalls == [] and g.to_dict()["finished"]["last_seq"] == 7
    text = render(g).splitlines()
    assert "  finished: the run drained (last batch 7); its parts stop by themselves" in text
    assert not any(x.startswith("  ok:") or "STALLED" in x for x in text)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_ctrl_c_ends_watch_with_0_and_no_traceback(tmp_path: Path) -> None:
    import signal

    _run(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "strawq", "status", str(tmp_path / "run"),
                             "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().startswith("run ")  # the first redraw is out
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
