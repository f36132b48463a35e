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
        "engine-0.log", "engine-1.log", "router.log", "producer-0.log", "collector.log"}
    with pytest.raises(OSError):  # the router is gone with the rest
        socket.create_connection(("127.0.0.1", int(router.rsplit(":", 1)[1])), timeout=2)
