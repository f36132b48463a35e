"""``strawq cluster up``: the quickstart cluster from one run config, as shipped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from strawq.app.cli import main
from strawq.app.run_config import RunConfig
from strawq.config import load_config

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "deploy" / "examples" / "quickstart.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_quickstart_config_loads_as_shipped() -> None:
    cfg = load_config(RunConfig, str(QUICKSTART))
    assert cfg.producer is not None and cfg.placement is not None
    assert not os.path.isabs(cfg.producer.run_dir)  # under the working directory
    assert cfg.producer.plugins.reward == "strawq.producers.rewards.count_task"
    assert cfg.producer.engine.router_url is not None
    assert cfg.producer.engine.router_url.startswith("http://127.0.0.1:")


def test_a_router_elsewhere_is_a_usage_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["cluster", "up", str(QUICKSTART), "--set",
               f"producer.run_dir={tmp_path / 'run'}",
               "--set", "producer.engine.router_url=http://10.0.0.5:30000"])
    assert rc == 2
    assert "must be http://127.0.0.1:PORT" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cluster_up_runs_the_quickstart_and_stops_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    router = f"http://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "strawq", "cluster", "up", str(QUICKSTART), "--set",
         f"producer.run_dir={run}", "--set", f"producer.engine.router_url={router}",
         "--prompts", "64", "--max-seconds", "240"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 240
        while not any((run / "batches").glob("0*")):  # the collector published a batch
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no batch within 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (out, err)
    assert "K = floor(C*E/G) = floor(64*2/8) = 16 group slots" in out
    assert out.rstrip().endswith("stopped") and "Traceback" not in err
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {
        "engine-0.log", "engine-1.log", "router.log", "producer-0.log", "collector.log",
        "incarnation"}
    with pytest.raises(OSError):  # the router is gone with the rest
        socket.create_connection(("127.0.0.1", int(router.rsplit(":", 1)[1])), timeout=2)


def test_cluster_up_refuses_a_live_run_before_it_starts_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second ``cluster up`` on a run whose collector is alive starts no engine, router or
    producer and touches no log: exit 1 naming the live collector."""
    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.data.dataset import Dataset
    from tests.collector.helpers import make_run, write_dataset

    run = tmp_path / "run"
    q = make_run(str(run))
    live = Collector(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 4)),
                     CollectorConfig())
    live.start(wait=False)  # this process: alive
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "collector.log").write_text("the first cluster's log\n")
    try:
        rc = main(["cluster", "up", str(QUICKSTART), "--set", f"producer.run_dir={run}",
                   "--set", f"producer.engine.router_url=http://127.0.0.1:{_free_port()}",
                   "--max-seconds", "5", "--quiet"])
    finally:
        live.close()
    err = capsys.readouterr().err
    assert rc == 1 and "is live: collector epoch 1" in err and "Nothing was started" in err
    assert sorted(p.name for p in logs.iterdir()) == ["collector.log"]
    assert (logs / "collector.log").read_text() == "the first cluster's log\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.jsonl", "logs", "run"]


@pytest.mark.process
def test_each_incarnation_appends_to_the_logs_under_its_own_header(tmp_path: Path) -> None:
    from strawq.app.cluster import Cluster, next_incarnation, producer_id

    firsts = []
    for _ in range(2):
        n = next_incarnation(str(tmp_path))
        cluster = Cluster(str(tmp_path), incarnation=n)
        child = cluster.spawn("collector", ["--version"])
        assert child.proc.wait(60) == 0
        firsts.append(child)
    text = (tmp_path / "logs" / "collector.log").read_text()
    assert "incarnation 1, collector started" in text  # the first incarnation's log is kept
    assert text.index("incarnation 1,") < text.index("incarnation 2,")
    assert text.count("strawq") >= 4  # both headers and both outputs
    assert "incarnation" not in firsts[1].tail()  # the tail is this incarnation's output
    ids = {producer_id(i, n) for n in (1, 2) for i in range(3)}
    assert len(ids) == 6  # no producer id is reused by a later incarnation


def test_the_written_producer_section_has_no_silent_one_slot_default(tmp_path: Path) -> None:
    from strawq.app.run_config import slots_explicit

    assert not slots_explicit(str(QUICKSTART), [])
    assert slots_explicit(str(QUICKSTART), ["producer.budget.slots=3"])
