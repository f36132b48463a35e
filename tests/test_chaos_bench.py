"""The chaos benchmark's quick form: real processes, a few kill -9 / SIGSTOP faults, and its own
total-queue, storage and invented checks must pass (bench/chaos.py exits 1 otherwise); each producer
kill is reported with its tokens in flight and the tokens regenerated after it; the fleet
time lost per failure kind is printed beside the crash figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import BENCH_QUICK_TIMEOUT_S, REPO

pytestmark = pytest.mark.slow


@pytest.mark.xdist_group("bench-chaos")  # the run test_quick_form_runs[chaos] checks too
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_chaos_bench_quick(bench_quick: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    proc = bench_quick("chaos")  # the run tests/bench/test_quick.py checks too
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    m = re.match(r"chaos: faults = (\d+), lost = 0, duplicated = 0, invented = 0, ", last)
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
    # and the operators' faults: a second trainer refused having trained nothing, a producer
    # restarted under its id whose leases go back, a rolling upgrade across a format change:
    # nothing lost or duplicated
    fleet = re.fullmatch(r"chaos: fleet seconds lost per failure = (\d+\.\d) \(producer "
                         r"(\d+\.\d), collector (\d+\.\d), trainer (\d+\.\d)\); two "
                         r"trainers: refused in \d+\.\d s, lost = 0, duplicated = 0; same "
                         r"producer id: leases back in \d+\.\d s, lost = 0, duplicated = 0; "
                         r"rolling upgrade: lost = 0, duplicated = 0",
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
    # the model's own tokens of every trained trajectory are the engines' answers
    assert re.search(r"^invented check: every trained response token of [1-9]\d* samples came "
                     r"from an engine's answer$", proc.stdout, re.M), proc.stdout[-3000:]
    landed = set(re.findall(r"^fault \d+: (?:kill9|sigstop) (producer|engine|tool)", proc.stderr,
                            re.M))
    assert landed == {"producer", "engine", "tool"}, proc.stderr[-2000:]
    # the trained trajectories hold tool calls, every one checked against the ledger
    calls = re.search(r"^agentic: (\d+) trajectories trained \(5 turns, tools 0\.05-0\.5 s\), "
                      r"(\d+) tool calls trained", proc.stdout, re.M)
    assert calls is not None and int(calls.group(1)) > 0 and int(calls.group(2)) > 0


@pytest.mark.timeout(400)
def test_chaos_bench_longgen_quick(tmp_path: Path) -> None:
    """Long generations under kill -9 of producers, engines, nodes and the collector, and a
    SIGTERM drain (bench/chaos_longgen.py): nothing lost or duplicated, every fault hit
    sequences in flight, the drain exited 0 and kept every token, and the token RPO line."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--workload",
                           "longgen", "--quick", "--workdir", str(tmp_path / "w"),
                           "--deadline", "240"], capture_output=True, text=True, timeout=390,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert re.search(r"^chaos longgen: faults = \d+, lost = 0, duplicated = 0, invented = 0, ",
                     proc.stdout, re.M), proc.stdout[-3000:]
    m = re.fullmatch(r"chaos: token RPO p50 = (\d+), p99 = (\d+) tokens \((\d+\.\d) s\); "
                     r"tokens regenerated per fault = (\d+) \(before: (\d+)\); drain kept = "
                     r"100 %; extra meta ops per producer-second = (\d+\.\d\d)", lines[-1])
    assert m is not None, lines[-1]
    p50, p99 = int(m.group(1)), int(m.group(2))
    assert p50 <= p99 and int(m.group(4)) > 0  # today a kill loses the segment in flight
    landed = set(re.findall(r"^fault \d+: (kill9|sigterm) (producer|engine|node|collector|"
                            r"sigterm)\d? \((\d+) sequences", proc.stderr, re.M))
    assert {(k, v) for k, v, _n in landed} == {
        ("kill9", "producer"), ("kill9", "engine"), ("kill9", "node"), ("kill9", "collector"),
        ("sigterm", "sigterm")}, proc.stderr[-2000:]
    assert all(int(n) > 0 for _k, v, n in landed if v != "collector")
    assert re.search(r"^drain: exit 0 after ", proc.stdout, re.M), proc.stdout[-2000:]


@pytest.mark.timeout(240)
def test_chaos_bench_weight_versions_quick(tmp_path: Path) -> None:
    """The trainer advances the weights under faults (bench/chaos_versions.py): ``flow``
    (micro-batches acked as trained, whole-step checkpoints) and ``old-weights`` (killed
    engines restart on version 0, repair on), side by side; every trained token was an
    engine's, under the version it was stamped with (bench/chaos.py exits 1 otherwise).
    ``stream`` and ``regenerate`` run the same code by hand (``--workload NAME --quick``)."""
    runs = {w: subprocess.Popen([sys.executable, str(REPO / "bench" / "chaos.py"),
                                 "--workload", w, "--quick", "--workdir", str(tmp_path / w),
                                 "--deadline", "150"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO)
            for w in ("flow", "old-weights")}
    for w, p in runs.items():
        out, err = p.communicate(timeout=230)
        assert p.returncode == 0, f"{w}:\n{out[-3000:]}\n{err[-3000:]}"
        last = out.strip().splitlines()[-1]
        m = re.fullmatch(rf"chaos {w}: faults = (\d+), lost = 0, duplicated = 0, invented = 0, "
                         r"tokens lost per fault = -?\d+, recovery p50 = (\d+\.\d\d|nan) s",
                         last)
        assert m is not None and int(m.group(1)) >= 3, last
        # every step pushed a new version (a restore from a checkpoint pushes one more)
        fig = re.search(rf"^{w}: (\d+) steps, weights advanced to version (\d+) \((\d+) "
                        r"pushes, \d+ engines missed, (\d+) restores from a checkpoint, .*; "
                        r"(\d+) samples checked, versions wrong = 0$", out, re.M)
        assert fig is not None, out[-3000:]
        steps, version, pushes, restores, checked = (int(x) for x in fig.groups())
        assert steps > 0 and version >= steps and pushes >= version, fig.group(0)
        dropped = re.search(r"^total-queue check: every row trained once or dropped with a "
                            r"reason \((\d+) dropped\)$", out, re.M)
        assert dropped is not None, out[-3000:]
        # every trained sample was checked: 48 prompts, groups of 4
        assert checked == 4 * (48 - int(dropped.group(1))), fig.group(0)


@pytest.mark.juicefs
@pytest.mark.timeout(200)
def test_chaos_bench_cluster_faults_quick(tmp_path: Path,
                                          juicefs_mounts: tuple[str, str]) -> None:
    """One fault of each cluster kind (every kind once per round): a producer's JuiceFS
    client killed and remounted, a producer cut off from the engines in its network
    namespace and healed, a producer restarted under libfaketime minutes off; each is
    counted by kind and in the per-victim table, and the checks pass."""
    sys.path.insert(0, str(REPO / "bench"))
    from chaos_cluster import jfs_client_unavailable, netns_unavailable, skew_unavailable

    a, b = juicefs_mounts
    d = os.path.dirname(a)
    if (os.path.basename(a), b) != ("A", os.path.join(d, "B")):
        pytest.skip(f"the test volume is not laid out as testvol.sh does (DIR/A, DIR/B): {a}, "
                    f"{b}")
    for why in (jfs_client_unavailable(d), netns_unavailable(), skew_unavailable()):
        if why is not None:
            pytest.skip(why)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--juicefs", d,
                           "--fault-kinds", "jfs-client,partition,skew", "--prompts", "80",
                           "--faults", "3", "--max-stop", "1", "--no-fleet", "--workdir",
                           str(tmp_path / "w"), "--deadline", "120"],
                          capture_output=True, text=True, timeout=190, cwd=REPO, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"chaos: faults = 3, lost = 0, duplicated = 0, invented = 0, tokens "
                        r"lost per fault = -?\d+, recovery p50 = (\d+\.\d\d|nan) s", last), last
    landed = re.findall(r"^fault \d+: (jfs-client|partition|skew) producer\d", proc.stderr,
                        re.M)
    assert sorted(landed) == ["jfs-client", "partition", "skew"], proc.stderr[-2000:]
    by_kind = re.search(r"^faults by kind: (.*)$", proc.stdout, re.M)
    assert by_kind is not None
    counts = dict(re.findall(r"([\w-]+) = (\d+) \(", by_kind.group(1)))
    assert counts == {"jfs-client": "1", "partition": "1", "skew": "1"}, by_kind.group(0)
    # the per-victim table has a column per cluster kind; the producers' rows sum to 3
    head = re.search(r"^victim +faults +kill9 +stop +jfs-client +partition +skew ", proc.stdout,
                     re.M)
    assert head is not None, proc.stdout[-3000:]
    rows = re.findall(r"^producer\d +(\d+) +0 +0 +(\d+) +(\d+) +(\d+) ", proc.stdout, re.M)
    assert sum(int(x) for r in rows for x in r[1:]) == 3 == sum(int(r[0]) for r in rows)
    # the mounts the bench added for the producers' hosts are gone
    assert not any(os.path.ismount(os.path.join(d, m)) for m in "CD")


@pytest.mark.timeout(120)
def test_a_missing_juicefs_binary_is_a_clear_refusal(tmp_path: Path) -> None:
    """``--juicefs`` where the volume cannot be mounted: one line saying why, exit 1, no
    traceback (it raised CalledProcessError)."""
    env = {**os.environ, "JUICEFS": str(tmp_path / "no-such-juicefs")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--quick",
                           "--juicefs", str(tmp_path / "vol"), "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=110, cwd=REPO, env=env,
                          check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "could not mount the JuiceFS test volume" in proc.stderr
    assert "no-such-juicefs" in proc.stderr
