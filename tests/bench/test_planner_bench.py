"""``bench/planner.py --quick``: the soak of what the feeder releases, checked against the
release model, ends with no mismatch and prints its anchor and the longest run's figures."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable

import pytest

from tests.conftest import BENCH_QUICK_TIMEOUT_S

pytestmark = pytest.mark.slow


@pytest.mark.xdist_group("bench-planner")  # the run test_quick_form_runs[planner] checks too
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_planner_bench_quick(bench_quick: Callable[..., subprocess.CompletedProcess[str]]
                             ) -> None:
    proc = bench_quick("planner")
    out = proc.stdout
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert proc.returncode == 0, f"{out[-4000:]}\n{proc.stderr[-3000:]}"
    m = re.fullmatch(r"planner: combinations = (\d+), rows checked = (\d+), mismatches with "
                     r"the model = 0", last)
    assert m is not None and int(m.group(1)) >= 10 and int(m.group(2)) > 100, last
    assert re.search(r"^anchor: one dataset, one pass, \d+ rows: [\d.]+ s = [\d.]+ ms/row$",
                     out, re.M), out[-2000:]
    assert re.search(r"^longest run: \d+ rows, .* = [\d.]+x the anchor \| ", out, re.M), \
        out[-2000:]
