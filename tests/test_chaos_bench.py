"""The chaos benchmark, tiny: real processes, a few kill -9 / SIGSTOP faults, and its own
total-queue and storage checks must pass (bench/chaos.py exits 1 otherwise)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_chaos_bench_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--prompts", "128",
                           "--faults", "7", "--gap", "0.3", "--workdir", str(tmp_path / "w"),
                           "--deadline", "150"], capture_output=True, text=True, timeout=230,
                          cwd=REPO, check=False)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    m = re.match(r"chaos: faults = (\d+), lost = 0, duplicated = 0, ", last)
    assert m is not None and int(m.group(1)) >= 3, last
