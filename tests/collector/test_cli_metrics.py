"""``strawq collector`` end to end, and the metrics sinks (JSONL + Prometheus)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.metrics import MetricsSink
from strawq.collector.trainer.reader import BatchReader
from strawq.config import from_dict
from strawq.data.dataset import Dataset
from strawq.errors import ConfigError
from tests.collector.helpers import SimProducer, make_run, write_dataset


@pytest.mark.process
@pytest.mark.timeout(60)
def test_help_explains_the_command():
    res = subprocess.run([sys.executable, "-m", "strawq.app.cli", "collector", "--help"],
                         capture_output=True, text=True, timeout=50, check=False)
    assert res.returncode == 0
    assert "staleness-first" in res.stdout and "--checkpoint" in res.stdout


@pytest.mark.process
@pytest.mark.timeout(90)
def test_cli_runs_until_drained_with_a_producer_and_trainer(tmp_path):
    q = make_run(str(tmp_path / "run"))
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 12)
    metrics = tmp_path / "collector.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "strawq.app.cli", "collector", str(tmp_path / "run"), ds,
         "--no-fsync", "--set", "batch_groups=4", "--set", "max_running=8",
         "--set", "max_ready=8", "--set", "poll_interval_s=0.01",
         "--set", "metrics_interval_s=0", "--set", f"metrics_jsonl={metrics}"],
        stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def produce():
        p = SimProducer(q, "p", seed=4)
        while not stop.is_set():
            p.step()
            stop.wait(0.005)
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    reader = BatchReader(q)
    got = []
    try:
        while len(got) < 12:
            b = reader.next_batch(timeout=30)
            got += [s["index"] for s in b.summaries]
            reader.ack(b)
        reader.commit(b.seq)  # the last checkpoint: the finished collector waits for it
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        stop.set()
        proc.kill()
        t.join(5)
    assert sorted(got) == list(range(12))
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert lines and {"queue/pending", "queue/ready", "collector/groups_per_s"} <= set(lines[0])


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(CollectorConfig, {"batch_group": 3})
    with pytest.raises(ConfigError, match="max_ready"):
        CollectorConfig(batch_groups=64, max_ready=8)
    with pytest.raises(ConfigError, match="eta_mode"):
        CollectorConfig(eta_mode="ignore")


@pytest.mark.timeout(30)
def test_metrics_jsonl_and_prometheus(tmp_path):
    sink = MetricsSink(str(tmp_path / "m.jsonl"), prometheus_port=0, addr="127.0.0.1")
    try:
        sink.emit({"staleness/mean": 1.5, "trainer/wait_ratio": 0.25, "note": "x"})
        sink.emit({"staleness/mean": 2.0})
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics",
                                      timeout=10).read().decode()
    finally:
        sink.close()
    assert "strawq_staleness_mean 2.0" in body
    assert "strawq_trainer_wait_ratio 0.25" in body
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["note"] == "x" and len(lines) == 2


@pytest.mark.timeout(60)
def test_reader_emits_one_line_per_step_with_wait_ratio(tmp_path):
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 8))
    col = Collector(q, ds, CollectorConfig(batch_groups=4, max_running=8, max_ready=8,
                                           poll_interval_s=0))
    col.start(wait=False)
    p = SimProducer(q, "p", seed=2)
    for _ in range(40):
        col.step()
        p.step()
    reader = BatchReader(q, metrics=MetricsSink(str(tmp_path / "r.jsonl")))
    for _ in range(2):
        reader.ack(reader.next_batch(timeout=5))
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert {"staleness/mean", "staleness/max", "staleness/multi_version_frac",
            "queue/pending", "queue/partial", "queue/leased", "queue/ready"} <= set(lines[0])
    assert "trainer/wait_ratio" in lines[1] and 0.0 <= lines[1]["trainer/wait_ratio"] <= 1.0
