"""The chaos benchmark's slime and operator workloads in their quick form: real processes, a
few kill -9 / SIGSTOP faults, the total-queue and storage checks (bench/chaos.py exits 1
otherwise); the slime one drives the queue through slime's own rollout path
(bench/chaos_slime.py), the operator one runs requeue/release/gc/bracket commands beside the
faults and fails on a traceback or a wrong decision (bench/chaos_operator.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.collector.integrations.conftest import SLIME_MISSING
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _quick(workload: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--workload",
                           workload, "--quick", "--workdir", str(tmp_path / "w"),
                           "--deadline", "120"], capture_output=True, text=True, timeout=190,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _last(proc: subprocess.CompletedProcess[str], workload: str) -> int:
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"chaos {workload}: faults = (\d+), lost = 0, duplicated = 0, "
                     r"invented = 0, tokens lost per fault = -?\d+, "
                     r"recovery p50 = (\d+\.\d\d|nan) s", last)
    assert m is not None, last
    # the trainer recorded what it trained, and every token of it was an engine's answer
    checked = re.search(r"^invented check: every trained response token of (\d+) samples "
                        r"came from an engine's answer$", proc.stdout, re.M)
    assert checked is not None and int(checked.group(1)) > 0, proc.stdout[-2000:]
    return int(m.group(1))


@pytest.mark.slime
@pytest.mark.timeout(200)
def test_chaos_bench_slime_quick(tmp_path: Path) -> None:
    pytest.importorskip("slime.utils.types", reason=SLIME_MISSING)
    proc = _quick("slime", tmp_path)
    assert _last(proc, "slime") >= 3
    assert "storage check: only live records after gc" in proc.stdout
    # the model checkpoints are slime's rollout ids, each with the data source's state
    names = set((tmp_path / "w" / "slime-ckpt" / "rollout").iterdir())
    assert names and all(re.fullmatch(r"strawq_reader_\d+\.json", n.name) for n in names)


@pytest.mark.timeout(200)
def test_chaos_bench_operator_quick(tmp_path: Path) -> None:
    proc = _quick("operator", tmp_path)
    assert _last(proc, "operator") >= 3
    m = re.search(r"^operator: (\d+) commands, 0 failed$", proc.stdout, re.M)
    assert m is not None and int(m.group(1)) >= 3, proc.stdout[-3000:]
