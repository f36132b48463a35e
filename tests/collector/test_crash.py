"""kill -9 of the collector and the trainer at random points of a real run, then resume.

Real subprocesses on a real directory: one collector, one trainer (weight update every 3
batches), two producers. The collector and the trainer are killed and restarted at seeded
random moments. At the end every dataset index must be trained exactly once or recorded
as dropped with a reason (docs/design.md, invariant 1).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from strawq.ondisk.names import TaskName
from tests.collector.helpers import make_run, write_dataset

pytestmark = pytest.mark.slow

PROCS = os.path.join(os.path.dirname(__file__), "procs.py")
N = 60


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, PROCS, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


def _check(run: str, out: str) -> tuple[dict[int, int], dict[int, str]]:
    trained: dict[int, int] = {}
    for n in os.listdir(out):
        if n.startswith("trained-"):
            with open(os.path.join(out, n), encoding="utf-8") as f:
                body = json.load(f)
            for i in body["indices"]:
                trained[i] = trained.get(i, 0) + 1
    dropped: dict[int, str] = {}
    for n in os.listdir(os.path.join(run, "dropped")):
        t = TaskName.parse(n)
        dropped[int(t.id[1:])] = t.producer or "?"
    return trained, dropped


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", [1, 2])
def test_kill9_collector_and_trainer_then_resume(tmp_path, seed):
    rng = random.Random(seed)
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    make_run(run)
    ds = write_dataset(str(tmp_path / "ds.jsonl"), N, seed=seed)
    producers = [_spawn("producer", run, f"p{i}", "--seed", str(seed * 10 + i))
                 for i in range(2)]
    collector = _spawn("collector", run, ds)
    trainer = _spawn("trainer", run, out, "--update-every", "3")
    kills = {"collector": 0, "trainer": 0}
    try:
        for _round in range(4):
            time.sleep(rng.uniform(0.3, 1.2))
            victim = rng.choice(["collector", "trainer"])
            if victim == "collector" and collector.poll() is None:
                _kill(collector)
                collector = _spawn("collector", run, ds)
                kills["collector"] += 1
            elif victim == "trainer":
                _kill(trainer)
                trainer = _spawn("trainer", run, out, "--update-every", "3")
                kills["trainer"] += 1
        # let the run drain: the collector exits 0 once every batch is acked
        rc = collector.wait(timeout=100)
        assert rc == 0, collector.stderr.read().decode() if collector.stderr else rc
    finally:
        open(os.path.join(out, "stop"), "w").close()
        open(os.path.join(tmp_path, "stop-producers"), "w").close()
        for p in [trainer, *producers]:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _kill(p)
        _kill(collector)
    trained, dropped = _check(run, out)
    twice = {i: c for i, c in trained.items() if c > 1}
    assert not twice, f"trained more than once: {twice}"
    both = set(trained) & set(dropped)
    assert not both, f"both trained and dropped: {sorted(both)}"
    missing = set(range(N)) - set(trained) - set(dropped)
    assert not missing, f"neither trained nor dropped: {sorted(missing)}"
    assert all(reason for reason in dropped.values())
    assert sum(kills.values()) == 4
    versions = [int(n) for n in os.listdir(os.path.join(run, "versions"))]
    assert versions and max(versions) >= 2, "the trainer's weight updates did not happen"
    assert len(trained) >= N // 2, f"only {len(trained)} trained; dropped {dropped}"
