"""Exactly one collector per run: refuse while the holder beats, take over when it is silent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import CollectorBusy
from strawq.collector.fencing import EpochFence
from strawq.data.dataset import Dataset
from strawq.errors import FencedOut
from tests.collector.helpers import FakeClock, make_run, write_dataset

CFG = CollectorConfig(batch_groups=2, max_running=4, max_ready=4, takeover_timeout_s=5.0,
                      poll_interval_s=0)


@pytest.fixture
def run(tmp_path):
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 20))
    return q, ds


@pytest.mark.timeout(30)
def test_second_collector_refuses_while_first_beats(run):
    q, ds = run
    first = Collector(q, ds, CFG)
    assert first.start(wait=False) == 1
    # the newcomer's sleep lets the first collector run a pass: its heartbeat moves
    clock = FakeClock(hook=first.step)
    second = Collector(q, ds, CFG, clock=clock, sleep=clock.sleep)
    with pytest.raises(CollectorBusy, match="alive"):
        second.start()
    with pytest.raises(CollectorBusy, match="did not close"):
        Collector(q, ds, CFG).start(wait=False)
    first.step()  # the first one still holds the run


@pytest.mark.timeout(30)
def test_takeover_after_silence_fences_the_old_one(run):
    q, ds = run
    first = Collector(q, ds, CFG)
    first.start(wait=False)
    first.step()
    clock = FakeClock()  # nobody beats while the newcomer watches
    second = Collector(q, ds, CFG, clock=clock, sleep=clock.sleep)
    assert second.start() == 2
    # it waited the full takeover timeout, not the run's shorter liveness timeout
    assert second.fence.timeout == CFG.takeover_timeout_s > q.config.liveness_s
    assert clock.t - 1000.0 >= second.fence.timeout
    second.step()
    with pytest.raises(FencedOut, match="taken over"):
        first.step()
    with pytest.raises(FencedOut):
        first.fence.check()
    # the stale one cannot publish a batch either: _publish checks the fence first
    with pytest.raises(FencedOut):
        first.former.publish([], [], {})


@pytest.mark.timeout(30)
def test_clean_close_lets_a_successor_start_at_once(run):
    q, ds = run
    first = Collector(q, ds, CFG)
    first.start(wait=False)
    first.close()
    clock = FakeClock()
    second = Collector(q, ds, CFG, clock=clock, sleep=clock.sleep)
    assert second.start(wait=False) == 2
    assert clock.t == 1000.0
    with pytest.raises(FencedOut):
        first.step()


@pytest.mark.timeout(30)
def test_two_newcomers_race_exactly_one_wins(run):
    q, _ds = run
    a = EpochFence(q.storage, owner="a")
    b = EpochFence(q.storage, owner="b")
    a.epoch = b.epoch = 0
    assert a._create(1) == 1
    with pytest.raises(CollectorBusy, match="first"):
        b._create(1)
    names = q.storage.list("collector")
    assert [n for n in names if n.startswith("epoch-")] == ["epoch-000000000001"]


@pytest.mark.timeout(30)
def test_old_epochs_are_collected(run):
    q, _ds = run
    for i in range(5):
        f = EpochFence(q.storage, owner=f"c{i}")
        assert f.acquire(wait=False) == i + 1
        f.beat()
        f.close()
    names = q.storage.list("collector")
    assert sorted(n for n in names if n.startswith("epoch-")) == [
        "epoch-000000000004", "epoch-000000000005"]
    assert not [n for n in names if n.startswith("hb-000000000001")]


@pytest.mark.process
@pytest.mark.timeout(60)
def test_cli_refuses_second_collector_process(run, tmp_path):
    q, ds = run
    holder = Collector(q, ds, CFG)
    holder.start(wait=False)
    cmd = [sys.executable, "-m", "strawq.app.cli", "collector", q.storage.local_path("run.meta")
           .rsplit("/", 1)[0], ds.url, "--no-wait", "--max-steps", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=50, check=False,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode != 0
    assert "did not close" in res.stderr
