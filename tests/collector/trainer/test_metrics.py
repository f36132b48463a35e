"""Metrics lines: timestamped, counters that survive a restart, Prometheus' naming rules."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.metrics import MetricsSink, prom_name
from strawq.data.dataset import Dataset
from tests.collector.helpers import make_run, write_dataset


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_every_line_is_timestamped(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    before = time.time()
    sink = MetricsSink(str(path))
    sink.emit({"staleness/mean": 1.0})
    sink.emit({"trainer/step": 1})
    assert all(before <= float(v["time"]) <= time.time() for v in _lines(path))  # type: ignore


def test_counters_continue_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first = MetricsSink(str(path))
    for step in (1, 2, 3):
        first.emit({"trainer/step": step, "trainer/wait_s": 0.5})
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"trainer/st')  # a torn last line from the crash
    second = MetricsSink(str(path))  # the trainer restarted: its own count starts at 1
    second.emit({"trainer/step": 1, "trainer/wait_s": 0.5})
    last = json.loads(path.read_text().splitlines()[-1])  # the torn line was ended
    assert last["trainer/step"] == 4
    assert last["trainer/wait_s"] == 0.5  # gauges are not accumulated


def test_collector_counters_continue_across_collector_restarts(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 20))
    path = tmp_path / "c.jsonl"
    cfg = CollectorConfig(metrics_jsonl=str(path), metrics_interval_s=0.0, batch_groups=2,
                          max_running=4, max_ready=4)
    for _ in range(2):
        col = Collector(q, ds, cfg)
        col.start(wait=False)
        col.step()
        col.close()
    lines = _lines(path)
    assert [v["collector/step"] for v in lines] == [1, 2]
    released = [v["collector/released_total"] for v in lines]
    assert released[1] >= released[0] > 0


def test_prometheus_names_follow_its_conventions(tmp_path: Path) -> None:
    assert prom_name("trainer/wait_s") == "strawq_trainer_wait_seconds"
    assert prom_name("collector/groups_per_s") == "strawq_collector_groups_per_second"
    assert prom_name("collector/batches_total") == "strawq_collector_batches_total"
    sink = MetricsSink(None, prometheus_port=0, addr="127.0.0.1")
    try:
        sink.emit({"trainer/wait_s": 0.25})
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics",
                                      timeout=10).read().decode()
    finally:
        sink.close()
    assert "strawq_trainer_wait_seconds 0.25" in body
    assert "strawq_time" not in body


def test_trainer_step_continues_after_a_trainer_restart(tmp_path: Path) -> None:
    from strawq.collector.trainer.reader import BatchReader
    from strawq.data.feeder import Feeder
    from strawq.delivery.batches import BatchStore
    from tests.collector.helpers import SimProducer

    q = make_run(str(tmp_path / "run"))
    Feeder(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 4))).release(4)
    p = SimProducer(q, "p", slots=4, max_new=(2, 4))
    for _ in range(10):
        p.step()
    bs = BatchStore(q)
    ready = bs.scan_ready()
    for seq, names in ((1, ready[:2]), (2, ready[2:])):
        bs.publish_batch(seq, names, [bs.read_summary(n) for n in names])
    path = tmp_path / "trainer.jsonl"
    for _incarnation in range(2):  # each trainer process reads and acks one batch
        reader = BatchReader.open(str(tmp_path / "run"), metrics_jsonl=str(path))
        reader.ack(reader.next_batch(timeout=5))
        reader.close()
    assert [v["trainer/step"] for v in _lines(path)] == [1, 2]


def test_collector_reports_engines_needing_weights(tmp_path: Path) -> None:
    from strawq.weights.engine_weights import EngineWeights

    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 4))
    path = tmp_path / "c.jsonl"
    col = Collector(q, ds, CollectorConfig(metrics_jsonl=str(path), metrics_interval_s=0.0,
                                           batch_groups=2, max_running=4, max_ready=4))
    col.start(wait=False)
    col.step()
    weights = EngineWeights(q.storage)
    weights.mark("http://e1:30000", writer="p0", engine_version=0, run_version=1, reason="r")
    weights.mark("http://e1:30000", writer="p1", engine_version=0, run_version=1, reason="r")
    weights.mark("http://e2:30000", writer="p1", engine_version=None, run_version=1, reason="r")
    col.step()
    col.close()
    assert [v["engines/needing_weights"] for v in _lines(path)] == [0, 2]  # per engine
