"""Fixtures for every test: the JuiceFS and real-SGLang tiers' (when their modules import)
and ``bench_quick``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
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


#: The tiers ``make test-fast`` leaves out. A test that starts an OS process (a CLI, an
#: engine or server process, a worker, Ray) must carry one of them: the check below fails it
#: otherwise, so the fast tier stays fast and the markers say what a test costs.
COSTLY_MARKERS = ("process", "slow", "ray", "juicefs", "sglang_real")

#: xdist groups (``--dist loadgroup``): the tests that share a session resource run on one
#: worker, so the resource is made once: the real SGLang server, the benchmarks' ``--quick``
#: runs (``bench_quick``), a Ray cluster's default ports, the private Redis-backed volume.
GROUP_BY_FIXTURE = {"bench_quick": "bench", "juicefs_redis_mounts": "juicefs-redis",
                    "juicefs_engine_dirs": "juicefs-redis"}
#: A benchmark's ``--quick`` run is shared by the tests of that one benchmark: one group per
#: benchmark (``bench-<name>``: ``test_quick_form_runs[name]`` here, an explicit
#: ``xdist_group`` on the others), so the benchmarks run side by side, not on one worker.


def _group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("sglang_real") is not None:
        return "sglang-real"
    if item.get_closest_marker("ray") is not None:
        return "ray"
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if "bench_quick" in names and callspec is not None and "name" in callspec.params:
        return f"bench-{callspec.params['name']}"
    for fixture, group in GROUP_BY_FIXTURE.items():
        if fixture in names:
            return group
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the real server is of the real tier (``-m sglang_real`` selects
    it, ``-m "not sglang_real"`` leaves it out), and the real tier's tests run last, in
    their collected order: the real CPU server, started by the first of them and kept up
    for the session, polls for work even when idle (most of a core), so ``make test`` runs
    them in a pass of their own after the parallel one. Tests that share a session
    resource get one xdist group. The shipped suites (``strawq.testing``) name their tests
    that start processes (``STARTS_PROCESSES``): those get the ``process`` marker here."""
    for item in items:
        harness = getattr(getattr(item, "cls", None), "STARTS_PROCESSES", frozenset())
        if getattr(item, "originalname", None) in harness:
            item.add_marker(pytest.mark.process)
        if (REAL_SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("sglang_real") is None):
            item.add_marker(pytest.mark.sglang_real)
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    real = [i for i in items if i.get_closest_marker("sglang_real") is not None]
    if real:
        chosen = set(map(id, real))
        items[:] = [i for i in items if id(i) not in chosen] + real


class _Spawns:
    """Counts the OS processes this (worker) process starts: ``subprocess`` (asyncio's
    too), ``os.fork`` and ``os.posix_spawn*``, and ``multiprocessing`` under any start
    method. Installed once per process at configure time."""

    count = 0
    #: what the last processes ran (the argv of a subprocess, else the call), for the message
    last: list[str] = []

    @classmethod
    def install(cls) -> None:
        import multiprocessing.process

        def counted(fn: Callable[..., object]) -> Callable[..., object]:
            def wrapper(*args: object, **kwargs: object) -> object:
                cls.count += 1
                what = args[1] if fn.__name__ == "_execute_child" else fn.__qualname__
                cls.last = [*cls.last[-4:], repr(what)[:160]]
                return fn(*args, **kwargs)
            wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
            return wrapper

        subprocess.Popen._execute_child = counted(  # type: ignore[attr-defined]
            subprocess.Popen._execute_child)  # type: ignore[attr-defined]
        base = multiprocessing.process.BaseProcess
        base.start = counted(base.start)  # type: ignore[method-assign]
        for name in ("fork", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                setattr(os, name, counted(getattr(os, name)))


def pytest_configure(config: pytest.Config) -> None:
    _Spawns.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_SPAWNS_AT_SETUP] = _Spawns.count
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    outcome = yield
    started = _Spawns.count - item.stash.get(_SPAWNS_AT_SETUP, _Spawns.count)
    if not started:
        return
    report = os.environ.get("STRAWQ_TIER_REPORT")
    if report:
        with open(report, "a", encoding="utf-8") as f:
            marks = ",".join(m for m in COSTLY_MARKERS if item.get_closest_marker(m))
            f.write(f"{item.nodeid}\t{started}\t{marks}\t{' | '.join(_Spawns.last)}\n")
        return
    if any(item.get_closest_marker(m) for m in COSTLY_MARKERS) or outcome.excinfo:
        return
    outcome.force_exception(pytest.fail.Exception(
        f"this test started {started} OS process(es) but carries none of the markers "
        f"{', '.join(COSTLY_MARKERS)}: mark it @pytest.mark.process (or the tier it "
        f"needs), so `make test-fast` leaves it out (the last ones: "
        f"{'; '.join(_Spawns.last)})", pytrace=False))


_SPAWNS_AT_SETUP = pytest.StashKey[int]()


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
            if name != "scale":  # queue_ops would add a JuiceFS row
                env.pop("STRAWQ_JUICEFS_A", None)
                env.pop("STRAWQ_JUICEFS_REDIS_A", None)  # (tests/bench/test_queue_ops_redis.py)
            runs[name] = subprocess.run(
                [sys.executable, str(REPO / "bench" / f"{name}.py"), "--quick"], cwd=cwd,
                env=env, capture_output=True, text=True, timeout=BENCH_QUICK_TIMEOUT_S,
                check=False)
        return runs[name]

    return run
