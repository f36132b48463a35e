"""``strawq producer``: one producer without Ray, stopped by SIGTERM like Slurm or systemd do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typing import Any

from tests.producers.helpers import ids, make_run

PLUGINS = "tests.producers.plugins_for_tests"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.process
def test_a_producer_process_generates_and_hands_back_on_sigterm(tmp_path: Path,
                                                                sim_engine: Any) -> None:
    n = 40
    q = make_run(str(tmp_path / "run"), n)
    code = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(tmp_path / "run"), "--engine",
         sim_engine.url, "--reward", f"{PLUGINS}.length_reward", "--slots", "2",
         "--set", "sampling.max_new_tokens=64", "--set", "timing.idle_poll_s=0.02", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while len(ids(q, "ready")) < 3:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no ready group within 60 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    stats = json.loads(out)
    assert stats["groups_completed"] >= 3
    assert ids(q, "leased") == []  # every held group was handed back


def test_an_engine_on_the_default_weight_version_is_refused_at_start(
        tmp_path: Path, capsys: Any) -> None:
    from strawq.app.cli import main
    from strawq.producers.engines.launch import EngineOptions
    from strawq.producers.engines.testing import EngineThread
    from tests.producers.conftest import FAST_SIM

    q = make_run(str(tmp_path / "run"), 4)
    with EngineThread(EngineOptions(kind="sim", weight_version="default", sim=FAST_SIM)) as eng:
        rc = main(["producer", str(tmp_path / "run"), "--engine", eng.url, "--reward",
                   f"{PLUGINS}.length_reward", "--max-seconds", "30", "--slots", "1"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "'default' is not an integer" in err and "--weight-version" in err
    assert "Traceback" not in err
    assert len(ids(q, "pending")) == 4 and ids(q, "dropped") == []  # nothing was burnt


DEAD = ["--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:10"]


@pytest.mark.slow
def test_the_slots_are_required_or_derived_never_a_silent_default(
        tmp_path: Path, capsys: Any) -> None:
    from strawq.app.cli import main

    q = make_run(str(tmp_path / "run"), 4)  # G = 4
    base = ["producer", str(tmp_path / "run"), *DEAD, "--reward", f"{PLUGINS}.length_reward",
            "--set", "engine.generation.eos_token_ids=[2]", "--max-seconds", "0.3", "--json"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "pass --slots N, or --concurrency C" in err and "floor(C*E/G)" in err
    assert len(ids(q, "pending")) == 4  # nothing was claimed
    assert main([*base, "--concurrency", "10"]) == 0
    out, err = capsys.readouterr()
    assert "5 group slots: K = floor(C*E/G) = floor(10*2/4) = 5" in err
    assert json.loads(out)["slots"] == 5
    assert main([*base, "--concurrency", "10", "--producers", "2"]) == 0
    out, err = capsys.readouterr()
    assert "2 group slots: K = floor(C*E/G) = floor(10*2/4) = 5, shared by 2" in err
    assert json.loads(out)["slots"] == 2
    assert main([*base, "--slots", "3"]) == 0
    out, err = capsys.readouterr()
    assert "3 group slots (--slots)" in err and json.loads(out)["slots"] == 3
    assert main([*base, "--concurrency", "1"]) == 2  # C*E < G: not one group fits
    assert "not enough engine concurrency" in capsys.readouterr().err


def test_a_scheme_less_engine_url_is_refused_when_parsed(tmp_path: Path, capsys: Any) -> None:
    """``--engine localhost:30000`` is a usage error naming the URL (not, later, missing EOS
    ids or an unreachable engine); nothing is claimed."""
    from strawq.app.cli import main

    q = make_run(str(tmp_path / "run"), 4)
    for flag in ("--engine", "--router"):
        with pytest.raises(SystemExit) as exit_:
            main(["producer", str(tmp_path / "run"), flag, "localhost:30000", "--slots", "1",
                  "--reward", f"{PLUGINS}.length_reward", "--max-seconds", "0.3"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "did you mean http://localhost:30000" in err, err
        assert "Traceback" not in err and "EOS" not in err
    assert len(ids(q, "pending")) == 4
