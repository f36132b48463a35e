"""No API key ever reaches a log, a record, ``strawq status``/``inspect`` or a config dump:
a short run with recognisable keys, then every output and every file is searched for them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.producers.helpers import ids, make_run

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PLUGINS = "tests.producers.plugins_for_tests"
API_KEY = "sk-strawq-canary-api-7f3e9a"
ADMIN_KEY = "sk-strawq-canary-admin-51b0c4"
CLI = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
      "sys.exit(main(sys.argv[1:]))"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _strawq(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True,
                          cwd=REPO, env=ENV, timeout=90, check=check)


@pytest.mark.process
def test_a_short_run_never_shows_its_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    q = make_run(str(run), 8)
    logs = tmp_path / "logs"  # files, not pipes: debug logging must never block a child
    logs.mkdir()
    engine = subprocess.Popen(
        [sys.executable, "-c", CLI, "engine", "serve", "--kind", "sim", "--port", "0",
         "--time-scale", "0.01", "--len-median", "16", "--len-cap", "48", "--weight-version",
         "0", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--log-level", "debug"],
        stdout=subprocess.PIPE, stderr=(logs / "engine.err").open("w"), text=True, cwd=REPO,
        env=ENV)
    outputs: list[str] = []
    try:
        assert engine.stdout is not None
        ready = engine.stdout.readline()
        assert ready.startswith("STRAWQ_ENGINE_READY"), ready
        url = ready.split()[1]
        config = tmp_path / "producer.json"
        config.write_text(json.dumps({"engine": {
            "client": {"api_key": API_KEY, "admin_api_key": ADMIN_KEY},
            "generation": {"eos_token_ids": [2]}}}))
        producer = subprocess.Popen(
            [sys.executable, "-c", CLI, "-v", "producer", str(run), "--engine", url,
             "--reward", f"{PLUGINS}.length_reward", "--slots", "2", "--config", str(config),
             "--set", "sampling.max_new_tokens=32", "--set", "timing.idle_poll_s=0.02",
             "--json"],
            stdout=(logs / "producer.out").open("w"), stderr=(logs / "producer.err").open("w"),
            cwd=REPO, env=ENV)
        try:
            deadline = time.monotonic() + 60
            while len(ids(q, "ready")) < 2:
                assert producer.poll() is None, (logs / "producer.err").read_text()
                assert time.monotonic() < deadline, "no ready group within 60 s"
                time.sleep(0.05)
            producer.send_signal(signal.SIGTERM)
            producer.wait(timeout=60)
        finally:
            if producer.poll() is None:
                producer.kill()
        assert producer.returncode == 0, (logs / "producer.err").read_text()
        # a wrong key's refusal (a config error) names the key, never its value
        bad = _strawq("producer", str(run), "--engine", url, "--reward",
                      f"{PLUGINS}.length_reward", "--slots", "1", "--set",
                      f"engine.client.api_key=[\"{API_KEY}\"]", check=False)
        assert bad.returncode != 0 and "api_key" in bad.stderr
        outputs += [bad.stdout, bad.stderr]
        for args in (["status", str(run)], ["--json", "status", str(run)],
                     ["inspect", str(run), "ready/" + sorted(os.listdir(run / "ready"))[0]]):
            done = _strawq(*args, check=False)
            outputs += [done.stdout, done.stderr]
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            outputs += [engine.communicate(timeout=30)[0]]
        finally:
            if engine.poll() is None:
                engine.kill()
    outputs += [p.read_text() for p in sorted(logs.iterdir())]
    assert "DEBUG" in outputs[-1] or "DEBUG" in "".join(outputs)  # the logs were verbose
    assert any("ready" in o for o in outputs)
    for key in (API_KEY, ADMIN_KEY):
        for text in outputs:
            assert key not in text, text
        for d, _, files in os.walk(run):
            for name in files:
                data = (Path(d) / name).read_bytes()
                assert key.encode() not in data, os.path.join(d, name)
