"""Fixtures for every test: the JuiceFS and real-SGLang tiers' (when their modules import)
and ``bench_quick``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

try:
    from tests.juicefs_fixtures import *  # noqa: F401,F403
except ImportError:  # pragma: no cover - the JuiceFS fixtures are optional
    pass

try:
    from tests.sglang_fixtures import *  # noqa: F401,F403
except ImportError:  # pragma: no cover - the real-tier fixtures are optional
    pass

REPO = Path(__file__).resolve().parents[1]

#: the fixtures that start the real SGLang server (once a session, then kept up)
REAL_SERVER_FIXTURES = {"sglang_real", "sglang_real_session"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real tier's tests run last, in their collected order: the real CPU server,
    started by the first of them and kept up for the session, polls for work even when
    idle (most of a core), so nothing else runs beside it."""
    real = [i for i in items if i.get_closest_marker("sglang_real") is not None
            or REAL_SERVER_FIXTURES & set(getattr(i, "fixturenames", ()))]
    if real:
        chosen = set(map(id, real))
        items[:] = [i for i in items if id(i) not in chosen] + real


#: the longest a benchmark's ``--quick`` form may run here
BENCH_QUICK_TIMEOUT_S = 320


@pytest.fixture(scope="session")
def bench_quick(tmp_path_factory: pytest.TempPathFactory
                ) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``python bench/<name>.py --quick`` as a user runs it (its own process, a fresh
    working directory), run once per test session: ``tests/bench/test_quick.py`` checks
    every benchmark's summary line from it, and the tests of one benchmark's figures read
    the same run instead of starting another (``extra_env`` counts at the first call)."""
    runs: dict[str, subprocess.CompletedProcess[str]] = {}

    def run(name: str, extra_env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        if name not in runs:
            cwd = tmp_path_factory.mktemp(f"bench-{name}")
            env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(cwd),
                   **(extra_env or {})}
            if name != "scale":
                env.pop("STRAWQ_JUICEFS_A", None)  # queue_ops would add a JuiceFS row
            runs[name] = subprocess.run(
                [sys.executable, str(REPO / "bench" / f"{name}.py"), "--quick"], cwd=cwd,
                env=env, capture_output=True, text=True, timeout=BENCH_QUICK_TIMEOUT_S,
                check=False)
        return runs[name]

    return run
