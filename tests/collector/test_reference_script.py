"""The prepared device check (deploy/gpu_check.sh) and the trainer benchmark run their CPU
path where no GPU is visible: the equivalence bench's last line, the reference tests, and
the demo with its trainer on the chosen device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BENCH_QUICK_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^trainer: max relative gradient error vs reference = (\S+) over (\d+) "
                  r"paths \(world sizes 1-4, megatron(, slime)?(, verl)?\)$", re.M)

#: each framework's own loop, killed and restarted (bench/trainer.py section 4)
LOOPS = re.compile(r"^trainer: framework loops = verl (\d+), slime (\d+), megatron (\d+) steps; "
                   r"samples trained twice = (\d+); samples never trained = (\d+); max relative "
                   r"gradient error vs reference = (\S+)$", re.M)

ONE_REFERENCE_TEST = "tests/collector/test_reference.py::test_reference_is_the_objective_by_hand"


@pytest.mark.xdist_group("bench-trainer")  # the run test_quick_form_runs[trainer] checks
@pytest.mark.slow
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_bench_quick_prints_the_figure_within_tolerance(bench_quick):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    proc = bench_quick("trainer")  # the run tests/bench/test_quick.py checks too
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = LINE.search(proc.stdout)
    assert m is not None, proc.stdout[-2000:]
    assert float(m.group(1)) <= 1e-5 and int(m.group(2)) >= 6
    assert "reader/gloo world=4" in proc.stdout and "megatron dp=" in proc.stdout
    pytest.importorskip("verl", reason="verl not installed: the framework loops line")
    pytest.importorskip("slime", reason="slime not installed: the framework loops line")
    loops = LOOPS.search(proc.stdout)
    assert loops is not None, proc.stdout[-2000:]
    verl, slime, megatron, twice, never = (int(x) for x in loops.groups()[:5])
    assert min(verl, slime, megatron) >= 4 and twice == never == 0
    assert float(loops.group(6)) <= 1e-5


@pytest.mark.xdist_group("bench-trainer")  # the run test_quick_form_runs[trainer] checks
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_script_runs_its_cpu_path(tmp_path, bench_quick):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    pytest.importorskip("ray", reason="the demo needs ray")
    # the script's first step is `bench/trainer.py --quick`, which this test session ran already
    # (CUDA_VISIBLE_DEVICES or not, it runs on the CPU here): the script is handed that output;
    # its second runs the reference tests, which this suite runs itself: one of them here
    bench = bench_quick("trainer")
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    (tmp_path / "bench.txt").write_text(bench.stdout, encoding="utf-8")
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "gpu_check.sh"), "--quick", "--out",
                           str(tmp_path / "out"), "--steps", "3", "--bench-output",
                           str(tmp_path / "bench.txt"), "--tests", ONE_REFERENCE_TEST],
                          capture_output=True, text=True,
                          timeout=880, cwd=str(ROOT), env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    assert "no CUDA device visible" in out and LINE.search(out) is not None
    assert re.search(r"gpu_check: demo on cpu: 3 steps, reward \S+ -> \S+", out)
    assert re.search(r"^1 passed", out, re.M), out[-3000:]
    assert re.search(r"^gpu_check: trainer: framework loops = verl \d+, slime \d+, megatron \d+ "
                     r"steps; samples trained twice = 0; samples never trained = 0;", out, re.M) \
        or "framework loops: not run" in out, out[-3000:]
    assert out.rstrip().endswith("gpu_check: ok")
