"""deploy/monitoring: the alert rules and the Grafana dashboard name only what a live run
exports, and every endpoint speaks Prometheus' conventions.

A small run (a collector, a simulated producer, a reader, a producer's own endpoint) is
scraped over HTTP and parsed with ``prometheus_client``'s parser of the text format.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.metrics import MetricsSink
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.producers.meter import ProducerStats
from strawq.producers.metrics import serve_producer_metrics
from strawq.weights.control import Control
from tests.collector.helpers import SimProducer, make_run, write_dataset

parser = pytest.importorskip("prometheus_client.parser")

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
RULES = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
NAME = re.compile(r"\bstrawq_[a-z0-9_]+")


def _scrape(port: int | None) -> str:
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body: bytes = r.read()
    return body.decode()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The exposition text of a live run's collector, reader and producer endpoints."""
    tmp = tmp_path_factory.mktemp("live")
    q = make_run(str(tmp / "run"))
    ds = Dataset(write_dataset(str(tmp / "ds.jsonl"), 8))
    col = Collector(q, ds, CollectorConfig(batch_groups=4, max_running=8, max_ready=8,
                                           poll_interval_s=0, metrics_interval_s=0,
                                           prometheus_port=0))
    reader = BatchReader(q, metrics=MetricsSink(None, 0, labels={"run": "run"}))
    prod = serve_producer_metrics(lambda: ProducerStats(producer_id="p").to_dict(),
                                  run="run", producer="p", port=0)
    try:
        col.start(wait=False)
        col.step()
        q.heartbeat("gone")
        q.drop(q.claim("gone", 1)[0], "bad_task", "a row the test drops")
        p = SimProducer(q, "p", seed=3)
        for _ in range(60):
            q.heartbeat("p")
            p.step()
            col.step()
        for _ in range(2):
            reader.ack(reader.next_batch(timeout=10))
        q.storage.publish("quarantine/x", b"torn")
        Control(q.storage).pause(1)
        q.heartbeat("p")  # just beat: live when the collector looks
        col.step()
        yield {"collector": _scrape(col.metrics.port), "reader": _scrape(reader.metrics.port
                                                                         if reader.metrics
                                                                         else None),
               "producer": _scrape(prod.port)}
    finally:
        col.close()
        if reader.metrics is not None:
            reader.metrics.close()
        prod.close()


def _families(text: str) -> list[Any]:
    return list(parser.text_string_to_metric_families(text))


def _samples(scraped: dict[str, str]) -> dict[str, Any]:
    return {s.name: s for text in scraped.values() for f in _families(text) for s in f.samples}


def _rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def _panel_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def test_every_rule_is_complete() -> None:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {"StrawqCollectorDown", "StrawqBracketOpenTooLong", "StrawqProducerDead",
            "StrawqNoLiveProducer", "StrawqDiskNearlyFull", "StrawqQuarantineGrowing",
            "StrawqNoBatch"} <= names
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_the_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + \
            p["gridPos"]["w"] <= 24, p["title"]
    assert "run" in {v["name"] for v in dash["templating"]["list"]}
    assert all('run=~"$run"' in t["expr"] for p in panels for t in p["targets"])


@pytest.mark.process
def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        reason = ("promtool is not installed (it comes with Prometheus; `make test` installs "
                  "Debian's prometheus package where apt-get runs as root)")
        if os.environ.get("STRAWQ_REQUIRE_PROMTOOL") == "1":
            pytest.fail(f"promtool required (STRAWQ_REQUIRE_PROMTOOL=1) but {reason}")
        pytest.skip(f"{reason}: the rules are checked here only by the YAML and metric-name "
                    "tests")
    res = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.timeout(120)
def test_rules_and_panels_name_only_exported_series(scraped: dict[str, str]) -> None:
    exported = set(_samples(scraped))
    named = {n for e in _rule_exprs() + _panel_exprs() for n in NAME.findall(e)}
    assert named, "no strawq series named by the rules or the dashboard"
    missing = sorted(named - exported)
    assert not missing, f"named by deploy/monitoring but not exported by a live run: {missing}"


@pytest.mark.timeout(120)
def test_exposition_follows_prometheus_conventions(scraped: dict[str, str]) -> None:
    for where, text in scraped.items():
        for fam in _families(text):
            assert fam.documentation and fam.documentation != fam.name, (where, fam.name)
            assert fam.documentation.endswith("."), (where, fam.name, fam.documentation)
            if fam.type == "counter":
                assert all(s.name == fam.name + "_total" for s in fam.samples
                           if not s.name.endswith("_created")), (where, fam.name)
            else:
                assert not fam.name.endswith("_total"), f"{where}: gauge {fam.name} ends _total"
            for s in fam.samples:
                assert s.labels.get("run") == "run", (where, s.name, s.labels)
    types = {f.name: f.type for f in _families(scraped["collector"])}
    for counter in ("strawq_collector_released", "strawq_collector_batches",
                    "strawq_collector_expired_leases", "strawq_collector_step",
                    "strawq_collector_stale_trained", "strawq_dropped_groups"):
        assert types.get(counter) == "counter", (counter, types.get(counter))


@pytest.mark.timeout(120)
def test_liveness_bracket_disk_and_quarantine_are_exported(scraped: dict[str, str]) -> None:
    s = _samples(scraped)
    assert s["strawq_collector_up"].value == 1
    per = {(f.name, x.labels.get("producer")): x.value for f in _families(scraped["collector"])
           for x in f.samples}
    assert per[("strawq_producer_up", "p")] == 1 and s["strawq_producers_live"].value >= 1
    assert per[("strawq_producer_heartbeat_age_seconds", "p")] >= 0
    assert s["strawq_producers_known"].value == 2  # p, and the one that claimed and left
    assert s["strawq_bracket_open"].value == 1
    assert s["strawq_bracket_open_seconds"].value >= 0
    assert s["strawq_queue_quarantined"].value == 1
    assert s["strawq_disk_free_bytes"].value > 0
    assert 0 < s["strawq_disk_free_ratio"].value <= 1
    prod = {f.name for f in _families(scraped["producer"])}
    assert {"strawq_producer_generation_tokens", "strawq_producer_slots",
            "strawq_producer_heartbeat_failing"} <= prod
