"""The chaos benchmark's quick form: real processes, a few kill -9 / SIGSTOP faults, and its own
total-queue and storage checks must pass (bench/chaos.py exits 1 otherwise); each producer
kill is reported with its tokens in flight and the tokens regenerated after it; the fleet
time lost per failure kind is printed beside the crash figures."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import BENCH_QUICK_TIMEOUT_S, REPO

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_chaos_bench_quick(bench_quick: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    proc = bench_quick("chaos")  # the run tests/bench/test_quick.py checks too
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    m = re.match(r"chaos: faults = (\d+), lost = 0, duplicated = 0, ", last)
    assert m is not None and int(m.group(1)) >= 3, last
    # every producer kill gets its in-flight vs regenerated figures, and a total
    kills = len(re.findall(r"^fault \d+: kill9 producer\d", proc.stderr, re.M))
    rows = re.findall(r"^ +\d+ producer\d\.r\d+ +\d+ +(\d+) +(\d+) +(\d+) +\d+ +\d+(?: .*)?$",
                      proc.stdout, re.M)
    assert len(rows) == kills, proc.stdout[-3000:]
    assert all(int(f) == int(r) + int(g) for f, r, g in rows), rows
    total = re.search(r"^producer kills: (\d+), tokens in flight = (\d+) \(\d+ received \+ "
                      r"\d+ running\), regenerated = \d+ ", proc.stdout, re.M)
    if kills:
        assert total is not None and int(total.group(1)) == kills, proc.stdout[-3000:]
        assert int(total.group(2)) == sum(int(f) for f, _r, _g in rows)
    else:
        assert total is None
    # the fleet time lost per failure of each kind, the line before the last
    fleet = re.fullmatch(r"chaos: fleet seconds lost per failure = (\d+\.\d) \(producer "
                         r"(\d+\.\d), collector (\d+\.\d), trainer (\d+\.\d)\)",
                         proc.stdout.strip().splitlines()[-2])
    assert fleet is not None, proc.stdout[-3000:]
    mean, *kinds = (float(x) for x in fleet.groups())
    # each figure is rounded to 0.1: the kinds' mean is off by up to 0.05, the mean by 0.05
    assert mean == pytest.approx(sum(kinds) / 3, abs=0.1 + 1e-9)


@pytest.mark.timeout(200)
def test_chaos_bench_agentic_quick(tmp_path: Path) -> None:
    """The agentic workload: producers, engines and the tool server killed and stopped
    mid-trajectory; the oracle's counts must be zero (bench/chaos.py exits 1 otherwise)."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--workload",
                           "agentic", "--quick", "--workdir", str(tmp_path / "w"),
                           "--deadline", "120"], capture_output=True, text=True, timeout=190,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"chaos agentic: faults = (\d+), lost = 0, duplicated = 0, tool effects "
                     r"applied twice = 0, persisted tool calls re-executed = 0, environment "
                     r"mismatches = 0, tokens lost per fault = -?\d+, recovery p50 = "
                     r"(\d+\.\d\d|nan) s", last)
    assert m is not None and int(m.group(1)) >= 5, last
    landed = set(re.findall(r"^fault \d+: (?:kill9|sigstop) (producer|engine|tool)", proc.stderr,
                            re.M))
    assert landed == {"producer", "engine", "tool"}, proc.stderr[-2000:]
    # the trained trajectories hold tool calls, every one checked against the ledger
    calls = re.search(r"^agentic: (\d+) trajectories trained \(5 turns, tools 0\.05-0\.5 s\), "
                      r"(\d+) tool calls trained", proc.stdout, re.M)
    assert calls is not None and int(calls.group(1)) > 0 and int(calls.group(2)) > 0
