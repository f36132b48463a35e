"""``bench/scale.py --control-plane --live SECONDS --quick``: every client of an 80-GPU run
at its real schedule against a Redis-backed JuiceFS volume, counted at the server (issue
40). Skips like the counted mode's test where the volume cannot be brought up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from strawq.config import QueueConfig

from tests.bench.test_scale_control_plane import REPO, _run_quick

LIVE = re.compile(
    r"^scale live: (?P<gpus>\d+) GPUs, (?P<clients>\d+) clients, achieved (?P<a>[\d.]+) of "
    r"wanted (?P<w>[\d.]+) ops/s \(share (?P<share>[\d.]+)\); Redis (?P<x>\d+) commands/s "
    r"steady \(p50\), (?P<y>\d+) per update over (?P<d>[\d.]+) s; model \(cost x rate\) "
    r"predicts (?P<p>\d+) commands/s steady, (?P<q>\d+) per update$")
REAL = re.compile(
    r"^scale live at real rates: (?P<gpus>\d+) GPUs driven at 1/(?P<f>[\d.]+) of their rates: "
    r"Redis (?P<x>\d+) commands/s steady, (?P<y>\d+) per update over (?P<d>[\d.]+) s; model "
    r"(?P<p>\d+) commands/s steady, (?P<q>\d+) per update; metadata server capacity = "
    r"(?P<c>\d+) ops/s; share = "
    r"(?P<share>[\d.]+) steady \(model (?P<mshare>[\d.]+)\), update (?P<ushare>[\d.]+)$")
IDLE = re.compile(r"the idle clients send (?P<q>\d+) of them")
ROW = re.compile(r"^  (?P<kind>\S.*?)\s+(?P<wanted>\d+)\s+(?P<done>\d+)\s+(?P<share>[\d.]+|nan)"
                 r"\s+[\d.]+|nan")


@pytest.mark.slow
@pytest.mark.juicefs
def test_the_live_line_has_its_shape_and_counts_what_reached_the_server(tmp_path: Path) -> None:
    # without the journal: the bracket parks and refills
    out = _run_quick(tmp_path, "--live", "8", "--trainer-watch", "rank0", "--journal-every-s", "0")
    m = LIVE.match(out[-1]) if out else None
    assert m, f"not the live line: {out[-4:]}"
    assert int(m["gpus"]) == 80 and int(m["clients"]) == 10 + 1 + 80, m.group(0)
    assert float(m["a"]) <= float(m["w"]) and float(m["w"]) > 0, m.group(0)
    assert int(m["x"]) > 0, "steady commands reached the server"
    assert int(m["y"]) > 0 and float(m["d"]) > 0, "the update's burst was measured"
    assert int(m["p"]) > 0 and int(m["q"]) > 0, "the model's prediction is printed"
    # the step was scaled to fit 8 s (and said so); every kind achieved at most its wanted
    assert any(line.startswith("live: a 60 s step and its update do not fit 8 s") for line in out)
    rows = [r for r in map(ROW.match, out) if r and r["kind"] != "operation"]
    kinds = {r["kind"].strip() for r in rows}
    assert {"heartbeat", "update: park (per producer)", "update: refill and load (per producer)",
            "rank 0: next_batch (real reader)"} <= kinds, kinds
    assert all(int(r["done"]) <= int(r["wanted"]) for r in rows), rows


@pytest.mark.slow
@pytest.mark.juicefs
def test_a_live_run_with_the_journal_writes_windows_and_holds_through_the_update(
        tmp_path: Path) -> None:
    """The defaults (the journal every 4 s, rank 0 watching): every producer writes its
    journal window on schedule, and at the update holds its groups (one window record each:
    the producer's default with the journal), with no park and no refill."""
    out = _run_quick(tmp_path, "--live", "8")
    m = LIVE.match(out[-1]) if out else None
    assert m, f"not the live line: {out[-4:]}"
    assert int(m["y"]) > 0 and int(m["q"]) > 0, m.group(0)
    rows = {r["kind"].strip(): r for r in map(ROW.match, out) if r and r["kind"] != "operation"}
    hold, window = rows["update: hold, a journal record (per producer)"], \
        rows["journal: window record"]
    # each of the 10 producers' record at each update, every one made
    assert int(hold["done"]) == int(hold["wanted"]) > 0 and int(hold["wanted"]) % 10 == 0, \
        hold.group(0)
    assert 0 < int(window["done"]) <= int(window["wanted"]), window.group(0)
    assert not {"update: park (per producer)", "update: refill and load (per producer)"} & \
        set(rows), set(rows)


@pytest.mark.process
def test_bad_live_flags_are_refused_without_a_trace() -> None:
    for flags, said in ((["--control-plane", "--live", "0"], "SECONDS > 0"),
                        (["--live", "5"], "needs --control-plane"),
                        (["--control-plane", "--live", "5", "--gpus", "80,x"], "a comma list"),
                        (["--control-plane", "--gpus", "80,160"], "one number without --live"),
                        (["--control-plane", "--live", "5", "--dilate", "0.5"], "F > 1"),
                        (["--control-plane", "--dilate", "2"], "needs --live")):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), *flags],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2, (flags, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and said in proc.stderr, (flags, proc.stderr)


def _live() -> Any:
    sys.path.insert(0, str(REPO / "bench"))
    import control_plane_live

    return control_plane_live


def test_a_dilated_run_keeps_every_count_and_divides_every_rate() -> None:
    """``--dilate F``: every steady operation's rate is the real run's over F, every
    count (an update's operations, the clients, the leases in flight, a journal window's
    tokens) is the real run's; a factor under 1 is refused."""
    live = _live()
    cp = sys.modules["control_plane"]
    for hold in (True, False):
        run = cp.Run(gpus=10_000, journal_every_s=4.0, trainer_watch="rank0", hold=hold)
        slow = live.dilated(run, 16.0)
        for attr in ("producers", "ranks", "rank_nodes", "in_flight", "batch_groups",
                     "pending_depth", "slots", "watchers", "held"):
            assert getattr(slow, attr) == getattr(run, attr), attr
        real, dil = cp.steady_rates(run), cp.steady_rates(slow)
        assert real.keys() == dil.keys()
        for name, rate in real.items():
            assert dil[name] == pytest.approx(rate / 16), name
        assert cp.burst_counts(slow) == cp.burst_counts(run)
        assert slow.journal_every_s * slow.journal_tok_s == pytest.approx(
            run.journal_every_s * run.journal_tok_s)
        assert slow.burst_window_s == 16 * run.burst_window_s
    assert live.dilated(run, 1.0) is run
    with pytest.raises(ValueError, match="at least 1"):
        live.dilated(run, 0.5)


def test_the_real_rates_multiply_the_clients_commands_and_count_the_idle_ones_once() -> None:
    live = _live()
    r = live.LiveResult(gpus=10_000, clients=11_251, seconds=600.0, wanted=100, achieved=100,
                        steady_p50=206.0, steady_max=300.0, burst_cmds=5_000.0, burst_raw=6_000,
                        burst_s=32.0, burst_done=True, model_steady=190.0, model_burst=4_000.0,
                        tally={}, quiet=6.0, dilate=16.0, capacity=100_000.0, window_s=10.0)
    assert r.real_steady == pytest.approx(200 * 16 + 6)
    m = REAL.match(r.real_line())
    assert m, r.real_line()
    assert int(m["x"]) == 3206 and int(m["p"]) == 3040 and float(m["d"]) == 10.0
    assert int(m["y"]) == 5_000 and int(m["q"]) == 4_000  # counts: not multiplied
    assert float(m["share"]) == pytest.approx(0.032, abs=1e-3)
    # the update: the steady rate and the update's commands over the counted mode's window
    assert float(m["ushare"]) == pytest.approx((3206 + 5_000 / 10.0) / 100_000, abs=1e-3)


@pytest.mark.slow
@pytest.mark.juicefs
def test_a_dilated_live_run_reports_its_real_rates_against_the_servers_capacity(
        tmp_path: Path) -> None:
    """``--dilate 2``: the run at half its rates, and a line that doubles the clients' part
    of the live commands a second (the idle clients' part once), against the capacity
    redis-benchmark measured for the run's mix."""
    out = _run_quick(tmp_path, "--live", "12", "--dilate", "2")
    assert any(line.startswith("dilated: every period times 2") for line in out), out[:5]
    live, real = LIVE.match(out[-2]), REAL.match(out[-1])
    assert live and real, out[-4:]
    idle = next(m for m in map(IDLE.search, out) if m)
    quiet = int(idle["q"])
    assert float(real["f"]) == 2
    assert abs(int(real["x"]) - (max(int(live["x"]) - quiet, 0) * 2 + quiet)) <= 2, \
        (live.group(0), real.group(0), quiet)
    assert abs(int(real["p"]) - 2 * int(live["p"])) <= 1, (live.group(0), real.group(0))
    assert int(real["c"]) > 0 and float(real["share"]) > 0, real.group(0)
    # the rates were halved: the heartbeat's period doubled, said in the plan line
    beat = f"heartbeat every {QueueConfig().heartbeat_interval_s * 2:g} s"
    assert any(beat in line for line in out if line.startswith("live: 80")), \
        [line for line in out if line.startswith("live: ")]
