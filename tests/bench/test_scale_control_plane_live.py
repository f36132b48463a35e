"""``bench/scale.py --control-plane --live SECONDS --quick``: every client of an 80-GPU run
at its real schedule against a Redis-backed JuiceFS volume, counted at the server (issue
40). Skips like the counted mode's test where the volume cannot be brought up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_scale_control_plane import REPO, _run_quick

LIVE = re.compile(
    r"^scale live: (?P<gpus>\d+) GPUs, (?P<clients>\d+) clients, achieved (?P<a>[\d.]+) of "
    r"wanted (?P<w>[\d.]+) ops/s \(share (?P<share>[\d.]+)\); Redis (?P<x>\d+) commands/s "
    r"steady \(p50\), (?P<y>\d+) per update over (?P<d>[\d.]+) s; model \(cost x rate\) "
    r"predicts (?P<p>\d+) commands/s steady, (?P<q>\d+) per update$")
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
                        (["--control-plane", "--gpus", "80,160"], "one number without --live")):
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), *flags],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2, (flags, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and said in proc.stderr, (flags, proc.stderr)
