"""A producer whose host clock is skewed: a real producer process under libfaketime.

libfaketime (Debian package ``faketime``) shifts every clock the process reads — the wall
clock and, by default, ``CLOCK_MONOTONIC`` too — by an offset, and can run them at another
rate (its sleeps stretch or shrink with it). The grantor (this test process, on the true
clock) judges the producer's leases from its heartbeat counter alone (docs/design.md,
invariant 3), so neither an offset nor a moderate rate change may expire a lease early,
keep one past its time, lose a task or make one twice.

Skipped, saying how to install it, where libfaketime is missing; required in
CI (``STRAWQ_REQUIRE_FAKETIME=1``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from strawq.tasks.grantor import LeaseMonitor
from strawq.testing.waiting import wait_until
from tests.producers.helpers import ids, make_run, names

PLUGINS = "tests.producers.plugins_for_tests"
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


def libfaketime_or_skip() -> str:
    """The preload library of libfaketime. (Its ``faketime`` command forks and waits, so a
    signal sent to it would not reach the producer: the library is preloaded directly.)"""
    found = None
    if shutil.which("faketime") is not None:
        found = next((str(p) for d in ("/usr/lib", "/usr/local/lib", "/usr/lib64")
                      for p in sorted(Path(d).glob("**/faketime/libfaketime.so.1"))), None)
    if found is None:
        reason = "libfaketime is not installed: apt-get install -y faketime"
        if os.environ.get("STRAWQ_REQUIRE_FAKETIME") == "1":
            pytest.fail(f"libfaketime required (STRAWQ_REQUIRE_FAKETIME=1) but {reason}")
        pytest.skip(reason)
    return found


def faked_env(lib: str, spec: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "LD_PRELOAD": lib, "FAKETIME": spec,
            "FAKETIME_NO_CACHE": "1"}


def clock_offset(lib: str, spec: str) -> float:
    """What a process under ``spec`` reads from the wall clock, less the true time."""
    out = subprocess.run([sys.executable, "-c", "import time; print(time.time())"],
                         env=faked_env(lib, spec), capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return float(out) - time.time()


def skewed_producer(lib: str, spec: str, run: Path, engine_url: str) -> subprocess.Popen[str]:
    """``strawq producer`` on ``run`` with its clocks as libfaketime's ``spec`` says."""
    code = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(run), "--engine",
         engine_url, "--reward", f"{PLUGINS}.length_reward", "--slots", "2",
         "--set", "sampling.max_new_tokens=32", "--set", "timing.idle_poll_s=0.02",
         "--set", "timing.control_poll_s=0.02", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=faked_env(lib, spec))


@pytest.mark.parametrize("spec,offset", [("+600s", 600), ("-600s", -600), ("+0 x0.5", 0)],
                         ids=["ten-minutes-ahead", "ten-minutes-behind", "half-speed"])
@pytest.mark.process
def test_a_skewed_producers_leases_are_judged_right_and_nothing_is_lost_or_made_twice(
        tmp_path: Path, sim_engine: Any, spec: str, offset: float) -> None:
    """The grantor scans all along on the true clock, with a lease timeout of 15
    heartbeat intervals: not one lease expires (none early), every task becomes ready
    once, on its first lease, and on SIGTERM the producer hands back what it holds. (A
    lease of a producer gone silent expires on the grantor's clock whatever the
    producer's: tests/strawq/test_queue_leases.py tests the expiry itself.)"""
    lib = libfaketime_or_skip()
    assert abs(clock_offset(lib, spec) - offset) < 30  # the skew is real
    n = 12
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=3.0, heartbeat_interval_s=0.2)
    monitor = LeaseMonitor(q)
    expired: list[str] = []
    started = time.monotonic()
    proc = skewed_producer(lib, spec, run, sim_engine.url)
    try:
        def settled() -> bool:
            expired.extend(monitor.scan().expired)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return len(ids(q, "ready")) == n

        wait_until(settled, 60, what="every task ready", poll_s=0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    if spec.endswith("x0.5"):  # its clock ran at half speed (its own seconds, from stats)
        assert json.loads(out)["wall_s"] < 0.75 * elapsed
    assert expired == []  # no lease expired early: the producer beat all along
    ready = names(q, "ready")
    assert sorted(t.id for t in ready) == sorted({t.id for t in ready}) and len(ready) == n
    assert all(t.gen == 0 for t in ready)  # each made on its first lease, never re-leased
    assert ids(q, "leased") == [] and ids(q, "dropped") == []
