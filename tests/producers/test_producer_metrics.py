"""``strawq producer --prometheus-port``: a producer serves its own metrics, by Prometheus'
conventions (counters ``_total``, HELP sentences, ``run`` and ``producer`` labels)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.meter import ProducerStats
from strawq.producers.metrics import producer_values
from strawq.views.prom import series
from tests.producers.helpers import ids, make_run

parser = pytest.importorskip("prometheus_client.parser")

PLUGINS = "tests.producers.plugins_for_tests"
REPO = Path(__file__).resolve().parents[2]


def test_counts_are_counters_and_present_values_gauges() -> None:
    s = ProducerStats(producer_id="p", slots=4, tokens_generated=7, paused=True,
                      drop_reasons={"reward_error": 2})
    kinds = {series(k).family: series(k).kind for k in producer_values(s.to_dict())}
    assert kinds["strawq_producer_generation_tokens_total"] == "counter"
    assert kinds["strawq_producer_groups_completed_total"] == "counter"
    assert kinds["strawq_producer_slots"] == "gauge"
    assert kinds["strawq_producer_paused"] == "gauge"
    assert kinds["strawq_producer_dropped_groups_total"] == "counter"
    assert producer_values(s.to_dict())["producer_dropped/reward_error"] == 2


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_producer_process_serves_its_metrics(tmp_path: Path, sim_engine: Any) -> None:
    q = make_run(str(tmp_path / "run"), 20)
    code = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(tmp_path / "run"), "--engine",
         sim_engine.url, "--reward", f"{PLUGINS}.length_reward", "--slots", "2",
         "--producer-id", "p-metrics", "--prometheus-port", "0",
         "--set", "sampling.max_new_tokens=64", "--set", "timing.idle_poll_s=0.02"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "the producer did not say where its metrics are"
        stderr = proc.stderr
        drain = threading.Thread(target=lambda: stderr.read(), daemon=True)
        drain.start()  # its log must never fill the pipe and block it
        deadline = time.monotonic() + 60
        while len(ids(q, "ready")) < 2:
            assert proc.poll() is None
            assert time.monotonic() < deadline, "no ready group within 60 s"
            time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    done = fams["strawq_producer_groups_completed"]
    assert done.type == "counter" and done.documentation != done.name
    sample = done.samples[0]
    assert sample.name == "strawq_producer_groups_completed_total"
    assert sample.labels == {"run": "run", "producer": "p-metrics"}
    assert sample.value >= 1
    assert fams["strawq_producer_slots"].samples[0].value == 2
    assert fams["strawq_producer_generation_tokens"].samples[0].value > 0
