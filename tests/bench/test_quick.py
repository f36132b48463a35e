"""Every benchmark in ``bench/`` runs in its ``--quick`` form and ends on its summary line.

A benchmark is a ``bench/*.py`` with a ``__main__`` block (``chaos_proxy.py`` is a module of
``chaos.py``, not one). Each runs as a user runs it, ``python bench/<name>.py --quick``, in
its own process (the session's ``bench_quick`` run, which the tests of a benchmark's own
figures share), and must exit 0 with ``<name>: ...`` as its last line (``SUMMARY`` names
the exceptions). A benchmark that needs something this machine may lack is skipped saying
what: ``queue_ops`` the straw-queue anchor (the ``bench`` extra), ``scale`` the two-client
JuiceFS volume, ``verl_queue`` verl. ``ELSEWHERE`` names the quick forms that run in their
subject's tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import BENCH_QUICK_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"

pytestmark = pytest.mark.slow
#: benchmarks whose summary line names their subject, not their file
SUMMARY = {"verl_queue": "verl"}


def benchmarks() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))


def _needs(name: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """Extra environment for ``name``, or a skip saying what this machine lacks."""
    if name == "queue_ops" and importlib.util.find_spec("straw") is None:
        pytest.skip("bench/queue_ops.py compares against straw-queue 0.1.6, not installed "
                    "(pip install -e '.[bench]')")
    if name == "verl_queue" and importlib.util.find_spec("verl") is None:
        pytest.skip("bench/verl_queue.py compares against verl 0.9.1's MessageQueue, not "
                    "installed (make install; docs/verl.md)")
    if name == "scale":
        a, b = request.getfixturevalue("juicefs_mounts")
        return {"STRAWQ_JUICEFS_A": a, "STRAWQ_JUICEFS_B": b}
    return {}


def test_the_benchmarks_are_found() -> None:
    found = benchmarks()
    assert "pipeline" in found and "queue_ops" in found, found
    assert "chaos_proxy" not in found, "a module of chaos.py, not a benchmark"


#: quick forms run beside the tests of their subject instead: ``routing`` needs the real
#: server, which the session starts for the engine tests (an idle real server still costs
#: CPU, so it is not started any earlier): tests/producers/test_routing.py
ELSEWHERE = {"routing"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.juicefs) if n == "scale"
                                  else n for n in benchmarks() if n not in ELSEWHERE])
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_quick_form_runs(name: str, request: pytest.FixtureRequest,
                         bench_quick: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    script = BENCH / f"{name}.py"
    assert "--quick" in script.read_text(encoding="utf-8"), f"bench/{name}.py has no --quick"
    proc = bench_quick(name, _needs(name, request))
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, (f"bench/{name}.py --quick exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert out and out[-1].startswith(f"{SUMMARY.get(name, name)}: "), (
        f"bench/{name}.py --quick did not end on its summary line: {out[-3:]}")
