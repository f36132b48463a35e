"""The demo's private Ray cluster leaves the host's Ray address file as it found it.

Ray's test cluster writes its address to ``<ray temp>/ray_current_cluster``; a later bare
``ray.init()`` on the host joins whatever that file names, and ``ray.init(num_cpus=...)``
then refuses to start ("When connecting to an existing cluster, num_cpus and num_gpus must
not be provided"). A demo killed with -9 never reaches its shutdown, so the file must be
put back right after the cluster starts. Each test runs the cluster in a child process
with its own ``RAY_TMPDIR``, so the host's real file is never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

REPO = str(Path(__file__).resolve().parents[2])

CHILD = """
import sys, time
from strawq.producers.placement import start_local_cluster
cluster = start_local_cluster(1)
print("UP", flush=True)
if sys.argv[1] == "hold":
    time.sleep(600)
cluster.shutdown()
print("DOWN", flush=True)
"""


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    # Short: Ray's socket paths under it must stay below the 107-byte limit.
    d = Path(tempfile.mkdtemp(prefix="rq", dir="/tmp"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def child(ray_tmp: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def address_file(ray_tmp: Path) -> Path:
    return ray_tmp / "ray" / "ray_current_cluster"


def test_a_demo_cluster_killed_with_9_leaves_no_address_behind(ray_tmp: Path) -> None:
    proc = child(ray_tmp, "hold")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "UP"
        assert not address_file(ray_tmp).exists(), "the running cluster advertised itself"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not address_file(ray_tmp).exists()
    # What a bare ray.init() on this host would now do: start its own instance.
    from ray._private.services import get_ray_address_from_environment
    saved = os.environ.pop("RAY_ADDRESS", None)
    try:
        assert get_ray_address_from_environment(None, str(ray_tmp / "ray")) is None
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved


def test_an_operators_ray_address_survives_the_demo_cluster(ray_tmp: Path) -> None:
    address_file(ray_tmp).parent.mkdir(parents=True)
    address_file(ray_tmp).write_text("10.9.8.7:6379")
    proc = child(ray_tmp, "run")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    assert out.split() == ["UP", "DOWN"]
    assert address_file(ray_tmp).read_text() == "10.9.8.7:6379"
