"""``bench/pipeline.py --quick`` runs the rolling weight update beside the global bracket and
prints the line comparing them. Only what holds whatever the machine's load is checked: the
staleness bound and nothing dropped (structural: the schedule waits for due groups under
``eta_mode=hard``), never a time."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest

from tests.conftest import BENCH_QUICK_TIMEOUT_S

pytestmark = pytest.mark.slow

NUM = r"(-?[\d.]+(?:e[-+]\d+)?|nan|inf)"
ROLLING = re.compile(
    rf"^pipeline: rolling/global trainer wait per update = {NUM} / {NUM} s, fleet pause = "
    rf"{NUM} / {NUM} engine-s, max staleness = (\d+) \(η = (\d+)\), dropped = (\d+), "
    rf"of ceiling = {NUM} \(steady {NUM}\)$", re.M)


WRITE = re.compile(rf"^pipeline: rolling trainer wait per update = {NUM} s; weights written "
                   rf"once = {NUM} s \(A/W = {NUM}\)$", re.M)


@pytest.mark.xdist_group("bench-pipeline")  # the run test_quick_form_runs[pipeline] checks too
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_the_quick_form_prints_the_rolling_line_within_eta_with_nothing_dropped(
        bench_quick: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    proc = bench_quick("pipeline")
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-4000:]}\n{proc.stderr[-3000:]}"
    found = ROLLING.findall(out)
    assert len(found) == 1, out[-3000:]
    staleness, eta, dropped = (int(x) for x in found[0][4:7])
    assert eta == 1
    assert staleness <= eta, found[0]
    assert dropped == 0, found[0]
    # the time to write the weights once, from the run's manifests: recorded (> 0), and
    # inside the trainer's wait for the update (one clock), so A/W >= 1
    writes = WRITE.findall(out)
    assert len(writes) == 1, out[-3000:]
    wait, write, ratio = (float(x) for x in writes[0])
    assert write > 0 and wait >= write and ratio >= 1.0, writes[0]
