"""A JuiceFS client dies under its producer (the ``juicefs mount`` process killed with
SIGKILL): that producer stops acting, its leases expire on the grantor's clock and go to
the producer on the other client, which finishes every group exactly once; after a
remount at the same path the first producer rejoins by itself.

The test brings up its own two-client volume (``deploy/juicefs/testvol.sh``) in a temporary
directory: it kills a client, so it never touches a shared test volume.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.producers.producer import Producer
from strawq.producers.sglang_client import ClientConfig
from strawq.storage import PosixStorage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.testing.conformance_hooks import eventually
from tests.juicefs_fixtures import TESTVOL, find_juicefs_binary
from tests.producers.helpers import config_with, ids, make_run, names, wait_for

pytestmark = [pytest.mark.juicefs, pytest.mark.slow, pytest.mark.timeout(180)]

#: the mount options of ``testvol.sh`` (a remount must match them)
MOUNT_OPTS = ["--open-cache", "0", "--negative-entry-cache", "0", "--heartbeat", "12s"]


@pytest.fixture
def own_volume(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """``(dir, mount_a, mount_b)``: a fresh two-client volume of this test alone."""
    binary = find_juicefs_binary()
    if binary is None or not os.path.exists("/dev/fuse"):
        pytest.skip("needs the juicefs binary and /dev/fuse (and root or CAP_SYS_ADMIN)")
    d = str(tmp_path / "jfs")
    env = {**os.environ, "JUICEFS": binary}
    up = subprocess.run([TESTVOL, "up", d], capture_output=True, text=True, timeout=120,
                        check=False, env=env)
    if up.returncode != 0:
        subprocess.run([TESTVOL, "down", d], capture_output=True, timeout=120, check=False)
        pytest.skip(f"cannot bring a JuiceFS test volume up here: {up.stderr[-800:]}")
    try:
        yield d, os.path.join(d, "A"), os.path.join(d, "B")
    finally:
        down = subprocess.run([TESTVOL, "down", d], capture_output=True, text=True,
                              timeout=120, check=False, env=env)
        if down.returncode != 0:
            for m in ("A", "B"):
                subprocess.run(["umount", "-l", os.path.join(d, m)], capture_output=True,
                               check=False)


def kill_client(mount: str) -> None:
    """SIGKILL the ``juicefs mount`` daemon serving ``mount`` (and its supervisor, which
    would restart it): only processes whose command line names this mount point."""
    with open(os.path.join(mount, ".config"), encoding="utf-8") as f:
        cfg = json.load(f)
    for pid in (cfg["Pid"], cfg["PPid"]):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
        # the daemon rewrites its argv into one (truncated) string: its own log file,
        # named after the mount point, comes early in it
        assert b"juicefs mount" in cmdline and os.fsencode(f"--log {mount}.log ") in cmdline, (
            f"pid {pid} is not the client of {mount}: {cmdline[:300]!r}")
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):  # the supervisor's socket, left behind by SIGKILL
        os.unlink(cfg["CommPath"])


def remount(d: str, name: str) -> None:
    """Mount client ``name`` again at the same path, as ``testvol.sh`` mounted it."""
    mnt = os.path.join(d, name)
    subprocess.run(["umount", "-l", mnt], capture_output=True, check=False, timeout=60)
    binary = find_juicefs_binary()
    assert binary is not None
    out = subprocess.run([binary, "mount", "-d", "--log", f"{d}/{name}.log", "--cache-dir",
                          f"{d}/c{name}", "--no-usage-report", "--backup-meta", "0",
                          *MOUNT_OPTS, f"sqlite3://{d}/meta.db", mnt],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def answers(path: str) -> bool:
    try:
        os.listdir(path)
    except OSError:
        return False
    return True


def test_a_dead_juicefs_client_hands_its_leases_over_and_its_producer_rejoins(
        own_volume: tuple[str, str, str], sim_engine: Any) -> None:
    d, mount_a, mount_b = own_volume
    first, second = 6, 4
    run_b = os.path.join(mount_b, "run")
    q = make_run(run_b, 0, rows=[], lease_timeout_s=2.0, heartbeat_interval_s=0.2)
    data = os.path.join(run_b, "data.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(first + second):
            f.write(json.dumps({"prompt": [3 + i, 5, 7], "target": 7, "count": 3}) + "\n")
    feeder = Feeder(q, Dataset(data))
    feeder.release(first)
    monitor = LeaseMonitor(RunQueue.open(PosixStorage(run_b, writer_id="grantor")))

    def producer(run: str) -> Producer:
        return Producer(config_with({
            "run_dir": run,
            "engine": {"workers": (sim_engine.url,),
                       "client": ClientConfig(generate_timeout_s=30)},
            "plugins": {"reward": "strawq.producers.rewards.count_task"},
            "budget": {"slots": 2},
            # short groups: the producer on A finishes its groups, finds them fenced and
            # tries to claim again well before its heartbeats give up
            "sampling": {"max_new_tokens": 300, "ignore_eos": True, "seed": 3},
            "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.05}}, {}))

    pa, pb = producer(os.path.join(mount_a, "run")), producer(run_b)
    seen: dict[str, Any] = {}

    def all_ready(n: int) -> bool:
        monitor.scan()  # the grantor, on its own clock, from the run seen through B
        return len(ids(q, "ready")) == n

    async def body() -> None:
        ta, tb = asyncio.create_task(pa.run()), asyncio.create_task(pb.run())
        try:
            await wait_for(lambda: pa.stats().busy_trajectories > 0, 30, "A generating")
            seen["a_done_before"] = pa.stats().groups_completed
            kill_client(mount_a)
            await wait_for(lambda: not answers(mount_a), 30, "A's mount to fail")
            await wait_for(lambda: all_ready(first), 60, "B to finish the first wave")
            assert not ta.done(), f"the producer on the dead client stopped: {ta.exception()}"
            seen["a_done_while_dead"] = pa.stats().groups_completed - seen["a_done_before"]
            seen["a_gave_up"] = pa.stats().leases_lost
            pb.request_stop()
            await tb
            remount(d, "A")
            feeder.release(second)
            await wait_for(lambda: all_ready(first + second) or ta.done(), 60,
                           "A to rejoin and finish")
            assert not ta.done(), f"the producer on A stopped: {ta.exception()}"
        finally:
            pa.request_stop()
            pb.request_stop()
            await asyncio.wait([ta, tb], timeout=60)
        # read once A has stopped: a group is ready (its rename done, in an I/O thread)
        # a moment before its producer counts it, and A's two slots finish together
        seen["a_done_after"] = pa.stats().groups_completed
        for t in (ta, tb):
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    asyncio.run(body())
    assert seen["a_done_while_dead"] == 0
    # every group exactly once, nothing left anywhere else
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(first + second))
    assert not ids(q, "pending") and not ids(q, "leased") and not ids(q, "dropped")
    # the second wave was released after B stopped: A did all of it once remounted, by the
    # ready names (each names the producer that completed it) and by A's own count
    second_ids = {f"i{i:012d}" for i in range(first, first + second)}
    a_id = pa.stats().producer_id
    assert {t.id: t.producer for t in names(q, "ready") if t.id in second_ids} == {
        t: a_id for t in second_ids}
    assert seen["a_done_after"] - seen["a_done_before"] >= second


def test_a_store_handle_outlives_its_juicefs_client(own_volume: tuple[str, str, str]) -> None:
    """A ``PosixStorage`` handle holds a descriptor of its run root on the mount; when the
    client is killed every call fails (ENOTCONN: the request is never sent), and once the
    client is mounted again at the same path the same handle's calls work again: the held
    descriptor, of the dead connection, is found stale and the path opened again."""
    d, mount_a, mount_b = own_volume
    st = PosixStorage(os.path.join(mount_a, "run"))
    st.publish("a/one", b"1")
    held = st._dirs.held("")
    assert held is not None
    syncer = PosixStorage(os.path.join(mount_a, "run"))
    syncer.sync_dirs(["a"])  # holds its descriptor too; its first call after is an fsync
    kill_client(mount_a)
    assert eventually(lambda: not answers(mount_a)), "the killed client's mount still answers"
    with pytest.raises(OSError):
        st.read("a/one")
    remount(d, "A")
    syncer.sync_dirs(["a"])
    assert st.read("a/one") == b"1"  # the stale descriptor dropped, the path opened again
    assert st._dirs.held("") != held
    st.publish("a/two", b"2")
    st.rename("a/two", "a/three")
    assert st.list("a") == ["one", "three"]
    assert PosixStorage(os.path.join(mount_b, "run")).read("a/three") == b"2"
