"""``strawq doctor``: verify a mount by measuring it, instead of trusting a declaration.

The queue relies on a handful of filesystem behaviours (``reference/filesystem-semantics.md``,
``docs/filesystem-contract.md``): rename with one winner, exclusive create, fsync of files
and directories, no torn publication, and, across clients of a shared mount, bounded
visibility lag. Mount options can silently break them (JuiceFS ``--writeback`` or
``--open-cache``, NFS ``nocto``, an object-store FUSE that copies on rename), so before a
run starts the queue *measures* them in a scratch directory ``.strawq-doctor-<uuid>/``:

* races between several **processes** (and, with ``peer``, across two clients) for
  ``rename``, ``O_EXCL`` and ``renameat2(RENAME_NOREPLACE)``: exactly one winner per round;
* file and directory fsync;
* publication by tmp + fsync + close + rename, read concurrently by another process (on the
  peer mount when given): every read sees nothing or the whole record;
* with ``peer``: delay until a new file is listed and readable on the other client, until a
  deleted name is gone there, and how long a replaced file stays stale there;
* the filesystem type and, for JuiceFS, the client's own settings (``.config`` at the mount
  root, and the mount process's command line for the metadata engine).

A report can be saved as a *storage declaration* (JSON) and later checked against a fresh
measurement; ``require_healthy`` is the cheap start-up gate. Library code: no printing
(``strawq.doctor_cli`` renders reports).
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import enum
import errno
import functools
import hashlib
import json
import logging
import math
import multiprocessing
import os
import queue
import re
import shutil
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from strawq.errors import ConfigError, DoctorFailed

log = logging.getLogger(__name__)

__all__ = [
    "DECLARATION_KEYS",
    "Check",
    "DoctorReport",
    "JuiceFSSettings",
    "MountInfo",
    "Status",
    "check_declaration",
    "compare_declaration",
    "declaration_from_report",
    "find_mount",
    "judge_race",
    "load_declaration",
    "require_healthy",
    "run_doctor",
    "write_declaration",
]

SCRATCH_PREFIX = ".strawq-doctor-"
#: A visibility/staleness window above this is a warning: the queue is designed for <= 1 s
#: (JuiceFS default TTLs); longer caches mean slower hand-offs, not lost work.
STALE_WARN_S = 2.0

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
try:
    _renameat2: Any = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
except OSError:  # pragma: no cover - non-glibc platforms
    _renameat2 = None

_LOCAL_TYPES = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs", "ramfs",
                "bcachefs"}
_NFS_TYPES = {"nfs", "nfs4"}
_OBJECT_STORE_FUSE = {"fuse.s3fs", "fuse.goofys", "fuse.mountpoint-s3", "fuse.gcsfuse",
                      "fuse.rclone", "fuse.geesefs", "fuse.blobfuse", "fuse.blobfuse2",
                      "fuse.s3ql", "fuse.ossfs", "fuse.cosfs"}


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """One verified property: a status, a sentence saying what was found, and numbers."""

    name: str
    status: Status
    detail: str
    measured: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MountInfo:
    """The mount that holds a path, from ``/proc/self/mountinfo``."""

    mount_point: str
    fs_type: str
    source: str
    mount_options: tuple[str, ...] = ()
    super_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class JuiceFSSettings:
    """What a JuiceFS client is running with; ``None`` where it could not be seen."""

    source: str  # ".config", "cmdline", or "none"
    version: str | None = None
    meta_scheme: str | None = None
    meta_url: str | None = None  # password redacted
    subcommand: str | None = None
    writeback: bool | None = None
    open_cache_s: float | None = None
    readdir_cache: bool | None = None
    attr_cache_s: float | None = None
    entry_cache_s: float | None = None
    dir_entry_cache_s: float | None = None
    negative_entry_cache_s: float | None = None
    heartbeat_s: float | None = None
    no_bgjob: bool | None = None
    trash_days: int | None = None


@dataclass
class DoctorReport:
    path: str
    peer: str | None
    mount: MountInfo
    profile: str
    checks: list[Check]
    juicefs: JuiceFSSettings | None
    client_version: str | None
    durability_description: str
    direct_mount: bool | None
    started_at: str
    elapsed_s: float = 0.0
    quick: bool = False

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings and skips are allowed)."""
        return not self.failed()

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.WARN]

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; have {[c.name for c in self.checks]}")

    def measured(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.checks:
            out.update(c.measured)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = [dict(asdict(c), status=c.status.value) for c in self.checks]
        d["ok"] = self.ok
        return d


# -- mount detection -----------------------------------------------------------------------

def _unescape(field_: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def find_mount(path: str, mountinfo: str = "/proc/self/mountinfo") -> MountInfo:
    """The innermost mount containing ``path`` (the last one listed wins for over-mounts)."""
    real = os.path.realpath(path)
    best: MountInfo | None = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        log.debug("cannot read %s: %s", mountinfo, exc)
        return MountInfo(mount_point="/", fs_type="unknown", source="unknown")
    for line in lines:
        parts = line.split()
        if "-" not in parts[6:]:
            continue
        sep = parts.index("-", 6)
        mp = _unescape(parts[4])
        if not (real == mp or real.startswith(mp.rstrip("/") + "/")):
            continue
        if best is None or len(mp) >= len(best.mount_point):
            best = MountInfo(
                mount_point=mp, fs_type=parts[sep + 1],
                source=_unescape(parts[sep + 2]) if len(parts) > sep + 2 else "",
                mount_options=tuple(parts[5].split(",")),
                super_options=tuple(parts[sep + 3].split(",")) if len(parts) > sep + 3 else (),
            )
    return best or MountInfo(mount_point="/", fs_type="unknown", source="unknown")


def _profile(fs_type: str) -> str:
    if fs_type.startswith("fuse.juicefs"):
        return "juicefs"
    if fs_type in _NFS_TYPES:
        return "nfs"
    return "local"


# -- JuiceFS client settings ---------------------------------------------------------------

_JFS_BOOL_FLAGS = {
    "-d", "--background", "--no-syslog", "--force", "--hide-internal", "--update-fstab",
    "--disable-transparent-hugepage", "--enable-xattr", "--enable-cap", "--enable-selinux",
    "--enable-ioctl", "--prefix-internal", "--backup-skip-trash", "--read-only", "--no-bgjob",
    "--sort-dir", "--fast-statfs", "--readdir-cache", "--check-storage", "--writeback",
    "--cache-partial-only", "--cache-large-write", "--no-usage-report", "--verbose", "--debug",
    "-v", "--quiet", "-q", "--trace", "--no-agent", "--no-color", "--enable-acl",
}


def _parse_duration(value: str) -> float | None:
    """JuiceFS durations: ``1.0s``, ``500ms``, ``2m``, ``1h``, or a bare number of seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ns|us|µs|ms|s|m|h)?\s*", value)
    if not m:
        return None
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return float(m.group(1)) * scale[m.group(2) or "s"]


def parse_juicefs_cmdline(argv: Sequence[str]) -> tuple[list[str], dict[str, str | bool]]:
    """Split a ``juicefs mount`` command line into positionals and ``--option`` values."""
    positionals: list[str] = []
    opts: dict[str, str | bool] = {}
    i = 1
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("-") and len(tok) > 1:
            key, eq, val = tok.partition("=")
            if eq:
                opts[key] = val
            elif key in _JFS_BOOL_FLAGS:
                opts[key] = True
            elif i + 1 < len(argv):
                opts[key] = argv[i + 1]
                i += 1
        else:
            positionals.append(tok)
        i += 1
    return positionals, opts


def redact_url(url: str) -> str:
    """Hide a password in ``scheme://user:password@host`` (never put secrets in reports)."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def _meta_scheme(meta_url: str) -> str:
    if "://" in meta_url:
        return meta_url.split("://", 1)[0].lower()
    return "redis"  # juicefs treats an address without a scheme as Redis


def _read_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if len(argv) == 1 and " " in argv[0]:
        # A daemonised `juicefs mount -d` rewrites its argv into one space-joined string.
        argv = argv[0].split()
    return argv


def _juicefs_cmdline(mount_point: str, pid_hint: int | None) -> list[str] | None:
    """The command line of the ``juicefs mount`` process serving ``mount_point``."""
    def matches(argv: list[str] | None) -> bool:
        if not argv or "juicefs" not in os.path.basename(argv[0]) and "juicefs" not in argv[:2]:
            return False
        pos, _ = parse_juicefs_cmdline(argv)
        return len(pos) >= 3 and os.path.realpath(pos[-1]) == os.path.realpath(mount_point)

    if pid_hint:
        argv = _read_cmdline(pid_hint)
        if matches(argv):
            return argv
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        argv = _read_cmdline(pid)
        if matches(argv):
            return argv
    return None


def _juicefs_config(mount_point: str) -> dict[str, Any] | None:
    for name in (".config", ".jfs.config"):  # --prefix-internal renames internal files
        try:
            with open(os.path.join(mount_point, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            return data
    return None


def juicefs_settings(mount_point: str) -> tuple[JuiceFSSettings, list[str] | None]:
    """Settings of the client behind ``mount_point``, and its (unredacted) command line."""
    cfg = _juicefs_config(mount_point)
    pid = cfg.get("Pid") if cfg else None
    argv = _juicefs_cmdline(mount_point, pid if isinstance(pid, int) else None)
    meta_url = subcommand = None
    opts: dict[str, str | bool] = {}
    if argv:
        pos, opts = parse_juicefs_cmdline(argv)
        subcommand, meta_url = pos[0], pos[-2]

    def ns(v: Any) -> float | None:
        return float(v) / 1e9 if isinstance(v, (int, float)) else None

    def dur(flag: str, default: float | None) -> float | None:
        v = opts.get(flag)
        return _parse_duration(v) if isinstance(v, str) else (default if argv else None)

    def flag(name: str) -> bool | None:
        v = opts.get(name)
        if isinstance(v, str):
            return v.lower() in ("1", "true", "yes")
        return bool(v) if argv else None

    common: dict[str, Any] = {
        "meta_scheme": _meta_scheme(meta_url) if meta_url else None,
        "meta_url": redact_url(meta_url) if meta_url else None, "subcommand": subcommand}
    if cfg is not None:
        meta = cfg.get("Meta", {}) or {}
        chunk = cfg.get("Chunk", {}) or {}
        fmt = cfg.get("Format", {}) or {}
        return JuiceFSSettings(
            source=".config", version=cfg.get("Version"), **common,
            writeback=chunk.get("Writeback"), open_cache_s=ns(meta.get("OpenCache")),
            readdir_cache=cfg.get("ReaddirCache"), attr_cache_s=ns(cfg.get("AttrTimeout")),
            entry_cache_s=ns(cfg.get("EntryTimeout")),
            dir_entry_cache_s=ns(cfg.get("DirEntryTimeout")),
            negative_entry_cache_s=ns(cfg.get("NegEntryTimeout")),
            heartbeat_s=ns(meta.get("Heartbeat")), no_bgjob=meta.get("NoBGJob"),
            trash_days=fmt.get("TrashDays"),
        ), argv
    if argv:
        return JuiceFSSettings(
            source="cmdline", **common, writeback=flag("--writeback"),
            open_cache_s=dur("--open-cache", 0.0), readdir_cache=flag("--readdir-cache"),
            attr_cache_s=dur("--attr-cache", 1.0), entry_cache_s=dur("--entry-cache", 1.0),
            dir_entry_cache_s=dur("--dir-entry-cache", 1.0),
            negative_entry_cache_s=dur("--negative-entry-cache", 0.0),
            heartbeat_s=dur("--heartbeat", 12.0), no_bgjob=flag("--no-bgjob"),
        ), argv
    return JuiceFSSettings(source="none"), None


def _binary_version(argv: list[str] | None) -> str | None:
    """``juicefs version`` of the mount's own binary (or the one on PATH)."""
    binary = argv[0] if argv and os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK) \
        else shutil.which("juicefs")
    if not binary:
        return None
    try:
        out = subprocess.run([binary, "version"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version\s+(\S+)", out.stdout + out.stderr)
    return m.group(1) if m else None


_DURABILITY: dict[str, tuple[Status, str]] = {
    "sqlite3": (Status.WARN, ("SQLite metadata: a single host only (other nodes cannot "
                             "share the database file safely); fine for tests, never for a "
                             "multi-node run")),
    "redis": (Status.WARN, ("Redis metadata: durable only with 'appendfsync always' on the "
                           "server ('everysec' may lose the last second of commits); doctor "
                           "cannot see the server's setting, check it yourself")),
    "badger": (Status.WARN, "Badger metadata: embedded, one client process only"),
    "memkv": (Status.FAIL, "in-memory metadata: nothing survives the client process"),
}
for _s in ("rediss", "unix"):
    _DURABILITY[_s] = _DURABILITY["redis"]
for _s in ("mysql", "postgres", "tikv", "etcd", "fdb"):
    _DURABILITY[_s] = (Status.PASS, f"{_s} metadata: transactional, committed synchronously")


def _juicefs_checks(s: JuiceFSSettings, binary_version: str | None) -> tuple[list[Check], str]:
    checks = [Check("juicefs_direct_mount", Status.PASS,
                    "a direct FUSE mount of the JuiceFS client (not an S3 gateway or WebDAV "
                    "view): rename and O_EXCL are metadata transactions")]
    if s.subcommand not in (None, "mount"):
        checks[0] = Check("juicefs_direct_mount", Status.FAIL,
                          f"served by 'juicefs {s.subcommand}', expected 'juicefs mount'")
    unseen = "could not read the client's settings (.config at the mount root and the " \
             "juicefs process command line are unreadable); run doctor as the mount's user"

    def option(name: str, value: Any, bad: bool, fail: Status, good: str, why: str) -> Check:
        if value is None:
            return Check(name, Status.WARN, unseen)
        return Check(name, fail if bad else Status.PASS,
                     f"{why}" if bad else good)

    checks.append(option("juicefs_writeback", s.writeback, bool(s.writeback), Status.FAIL,
                         "writeback off: fsync/close returns after the object store has the "
                         "blocks", "--writeback is on: a commit precedes the upload, so losing "
                         "this node's cache disk loses published records; remount without it"))
    checks.append(option("juicefs_open_cache", s.open_cache_s, bool(s.open_cache_s),
                         Status.FAIL, "--open-cache 0: every open asks the metadata engine "
                         "(close-to-open kept)", f"--open-cache {s.open_cache_s}s reuses open "
                         "files without checking for updates (breaks close-to-open); "
                         "remount with --open-cache 0"))
    checks.append(option("juicefs_readdir_cache", s.readdir_cache, bool(s.readdir_cache),
                         Status.WARN, "readdir cache off: listings come from the metadata "
                         "engine", "--readdir-cache is on: listings can be stale for the attr "
                         "TTL (new tasks found late, claimed ones listed); remount without it"))
    ttls = {"attr": s.attr_cache_s, "entry": s.entry_cache_s, "dir-entry": s.dir_entry_cache_s,
            "negative-entry": s.negative_entry_cache_s}
    known = {k: v for k, v in ttls.items() if v is not None}
    if not known:
        checks.append(Check("juicefs_meta_cache", Status.WARN, unseen))
    else:
        long_ = {k: v for k, v in known.items() if v > 1.0 or (k == "negative-entry" and v > 0)}
        text = ", ".join(f"{k} {v:g}s" for k, v in known.items())
        checks.append(Check(
            "juicefs_meta_cache", Status.WARN if long_ else Status.PASS,
            (f"kernel metadata caches {text}: "
             + ("longer than the queue's <= 1 s staleness design (negative-entry should be 0)"
                if long_ else "within the queue's <= 1 s staleness design")),
            {f"juicefs_{k.replace('-', '_')}_cache_s": v for k, v in known.items()}))
    if s.no_bgjob:
        checks.append(Check("juicefs_bgjob", Status.WARN,
                            "--no-bgjob: make sure at least one other client runs background "
                            "jobs, or stale sessions (and their locks) are never cleaned"))
    version = s.version or binary_version
    if version:
        extra = "" if not binary_version or binary_version == version else \
            f" (the juicefs binary on this host is {binary_version})"
        checks.append(Check("juicefs_version", Status.PASS, f"client {version}{extra}"))
    else:
        checks.append(Check("juicefs_version", Status.WARN, "client version unknown"))
    if s.meta_scheme is None:
        durability = "metadata engine unknown (the mount's command line is not readable)"
        checks.append(Check("juicefs_durability", Status.WARN, durability))
    else:
        status, durability = _DURABILITY.get(
            s.meta_scheme, (Status.WARN, f"{s.meta_scheme} metadata: durability not assessed"))
        checks.append(Check("juicefs_durability", status, f"{durability} [{s.meta_url}]"))
    return checks, durability


# -- races between processes ---------------------------------------------------------------

def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _renameat2_noreplace(src: str, dst: str) -> None:
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this C library")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                  _RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), dst)


def _race_once(kind: str, base: str, rnd: int, index: int) -> str:
    try:
        if kind == "rename":
            os.rename(os.path.join(base, f"ren.{rnd}"), os.path.join(base, f"ren.{rnd}.w{index}"))
        elif kind == "excl":
            fd = os.open(os.path.join(base, f"excl.{rnd}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644)
            try:
                os.write(fd, str(index).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            src = os.path.join(base, f"nr.{rnd}.src{index}")
            try:
                _renameat2_noreplace(src, os.path.join(base, f"nr.{rnd}"))
            except OSError:
                os.unlink(src)
                raise
    except OSError as exc:
        return _errname(exc)
    return "won"


def _race_worker(index: int, base: str, rounds: int, kinds: Sequence[str], barrier: Any,
                 results: Any) -> None:
    """One racer: for every round and kind, wait on the barrier, then try to win."""
    out: dict[str, list[str]] = {k: [] for k in kinds}
    error = None
    try:
        for rnd in range(rounds):
            for kind in kinds:
                if kind == "noreplace":  # each racer publishes its own record
                    src = os.path.join(base, f"nr.{rnd}.src{index}")
                    with open(src, "wb") as f:
                        f.write(str(index).encode())
                        os.fsync(f.fileno())
                barrier.wait()
                out[kind].append(_race_once(kind, base, rnd, index))
    except Exception as exc:  # noqa: BLE001 - report anything; never leave the parent waiting
        error = f"{type(exc).__name__}: {exc}"
    results.put((index, out, error))


def judge_race(name: str, what: str, outcomes: Sequence[Sequence[str]],
               losers_may: Sequence[str], problems: Sequence[str] = ()) -> Check:
    """A race check from per-round outcomes (``outcomes[round][racer]``).

    Passes when every round has exactly one ``"won"`` and every loser failed with one of
    ``losers_may`` (errno names); ``problems`` are extra findings (e.g. post-conditions).
    """
    found = list(problems)
    for rnd, row in enumerate(outcomes):
        winners = [i for i, o in enumerate(row) if o == "won"]
        if len(winners) != 1:
            found.append(f"round {rnd}: {len(winners)} winners (racers {winners}), expected 1")
        odd = sorted({o for o in row if o != "won" and o not in losers_may})
        if odd:
            found.append(f"round {rnd}: losers failed with {odd}, expected {list(losers_may)}")
    racers = max((len(r) for r in outcomes), default=0)
    measured = {f"{name}_rounds": float(len(outcomes)), f"{name}_racers": float(racers)}
    if found:
        more = f" (+{len(found) - 5} more)" if len(found) > 5 else ""
        return Check(name, Status.FAIL, f"{what}: " + "; ".join(found[:5]) + more, measured)
    return Check(name, Status.PASS, f"{what}: exactly one winner in each of {len(outcomes)} "
                 f"rounds of {racers} racing processes", measured)


def _run_races(dirs: Sequence[str], rounds: int, processes: int, kinds: Sequence[str],
               ctx: Any, deadline_s: float) -> tuple[dict[str, list[list[str]]], list[str]]:
    """Start ``processes`` racers (alternating over ``dirs``); outcomes per kind and round."""
    barrier = ctx.Barrier(processes, timeout=deadline_s)
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, name=f"strawq-doctor-racer-{i}",
                         args=(i, dirs[i % len(dirs)], rounds, list(kinds), barrier, results),
                         daemon=True) for i in range(processes)]
    for p in procs:
        p.start()
    per_racer: dict[int, dict[str, list[str]]] = {}
    errors: list[str] = []
    end = time.monotonic() + 2 * deadline_s + rounds * len(kinds)  # ~1 s per race, max
    try:
        while len(per_racer) + len(errors) < processes:
            left = end - time.monotonic()
            if left <= 0:
                errors.append(f"only {len(per_racer)} of {processes} racers reported in time")
                break
            try:
                index, out, error = results.get(timeout=min(left, 1.0))
            except queue.Empty:  # check for dead racers, then wait again
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"racer processes died: {dead}")
                    break
                continue
            if error:
                errors.append(f"racer {index}: {error}")
            per_racer[index] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    table: dict[str, list[list[str]]] = {}
    for kind in kinds:
        table[kind] = [[per_racer[i][kind][r] if i in per_racer and r < len(per_racer[i][kind])
                        else "missing" for i in range(processes)] for r in range(rounds)]
    return table, errors


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _race_postconditions(scratch: str, table: Mapping[str, list[list[str]]]) -> dict[str, list[str]]:
    """The file system after the race must agree with who was told they won."""
    found: dict[str, list[str]] = {k: [] for k in table}
    for kind, rows in table.items():
        for rnd, row in enumerate(rows):
            winners = [i for i, o in enumerate(row) if o == "won"]
            if kind == "rename":
                if os.path.lexists(os.path.join(scratch, f"ren.{rnd}")):
                    found[kind].append(f"round {rnd}: the source still exists after the race")
                dsts = sorted(n for n in os.listdir(scratch) if n.startswith(f"ren.{rnd}.w"))
                if dsts != [f"ren.{rnd}.w{i}" for i in winners]:
                    found[kind].append(f"round {rnd}: destinations {dsts} but winners {winners}")
            else:
                target = os.path.join(scratch, f"{'excl' if kind == 'excl' else 'nr'}.{rnd}")
                content = _read_small(target)
                if len(winners) == 1 and content != str(winners[0]):
                    found[kind].append(f"round {rnd}: target holds {content!r}, winner was "
                                       f"racer {winners[0]}")
    return found


# -- publication and visibility ------------------------------------------------------------

_FRAME = struct.Struct("<Q32s")


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body), hashlib.sha256(body).digest()) + body


def _intact(data: bytes) -> bool:
    if len(data) < _FRAME.size:
        return False
    n, digest = _FRAME.unpack_from(data)
    body = data[_FRAME.size:]
    return bool(len(body) == n and hashlib.sha256(body).digest() == digest)


def _publish(scratch: str, rel: str, data: bytes, *, chunk: int = 64 * 1024) -> None:
    """tmp + fsync + close + rename + directory fsync, the queue's discipline."""
    tmp = os.path.join(scratch, "tmp", uuid.uuid4().hex)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for off in range(0, len(data), chunk):
            os.write(fd, data[off:off + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    dst = os.path.join(scratch, rel)
    os.rename(tmp, dst)
    _fsync_dir(os.path.dirname(dst))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torn_reader(directory: str, expected: int, deadline_s: float, ready: Any, stop: Any,
                 results: Any) -> None:
    """Read every name the moment it is listed; record any that is not whole."""
    seen: set[str] = set()
    torn: list[str] = []
    end = time.monotonic() + deadline_s
    ready.set()
    try:
        while time.monotonic() < end and not stop.is_set():
            names = [n for n in os.listdir(directory) if not n.startswith(".")]
            for name in names:
                if name in seen or name == "done":
                    continue
                seen.add(name)
                try:
                    with open(os.path.join(directory, name), "rb") as f:
                        data = f.read()
                except OSError as exc:
                    torn.append(f"{name}: listed but unreadable ({_errname(exc)})")
                    continue
                if not _intact(data):
                    torn.append(f"{name}: {len(data)} bytes, not the whole record")
            if "done" in names and len(seen) >= expected:
                break
            time.sleep(0.0005)
    except Exception as exc:  # noqa: BLE001 - reported as a finding, never a hang
        torn.append(f"reader error: {type(exc).__name__}: {exc}")
    results.put((len(seen), torn))


def _percentiles(prefix: str, xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def rank(q: float) -> float:
        return s[max(0, math.ceil(q * len(s)) - 1)]

    return {f"{prefix}_p50_s": rank(0.5), f"{prefix}_p99_s": rank(0.99), f"{prefix}_max_s": s[-1]}


def _poll(pending: dict[str, float], probe: Callable[[str], bool], deadline_s: float
          ) -> tuple[dict[str, float], list[str]]:
    """Poll ``probe(name)`` for each name until true; delay since ``pending[name]``."""
    done: dict[str, float] = {}
    end = time.perf_counter() + deadline_s
    while len(done) < len(pending) and time.perf_counter() < end:
        for name, t0 in pending.items():
            if name not in done and probe(name):
                done[name] = max(0.0, time.perf_counter() - t0)
        if len(done) < len(pending):
            time.sleep(0.0005)
    return done, sorted(set(pending) - set(done))


def _window_check(name: str, what: str, delays: Mapping[str, float], missing: Sequence[str],
                  prefix: str, deadline_s: float) -> Check:
    measured = _percentiles(prefix, list(delays.values()))
    if missing:
        return Check(name, Status.FAIL, f"{what}: {len(missing)} of {len(delays) + len(missing)}"
                     f" still not seen after {deadline_s:g}s (e.g. {missing[0]})", measured)
    worst = measured.get(f"{prefix}_max_s", 0.0)
    text = (f"{what}: p50 {measured[f'{prefix}_p50_s'] * 1e3:.1f} ms, p99 "
            f"{measured[f'{prefix}_p99_s'] * 1e3:.1f} ms, max {worst * 1e3:.1f} ms over "
            f"{len(delays)} files")
    if worst > STALE_WARN_S:
        return Check(name, Status.WARN, text + f" (above {STALE_WARN_S:g}s: longer metadata "
                     "caches than the queue is tuned for)", measured)
    return Check(name, Status.PASS, text, measured)


def _exists(path: str) -> bool:
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def _reads_in(directory: str, expected: bytes, name: str) -> bool:
    return _reads(os.path.join(directory, name), expected)


def _reads(path: str, expected: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == expected
    except OSError:
        return False


def _visibility_checks(a: str, b: str, samples: int, deadline_s: float) -> list[Check]:
    """New, deleted and replaced files on client A as seen from client B."""
    checks: list[Check] = []
    os.makedirs(os.path.join(a, "vis"))
    _fsync_dir(a)
    vis_b = os.path.join(b, "vis")
    _, missing = _poll({"vis": time.perf_counter()}, lambda _: os.path.isdir(vis_b), deadline_s)
    if missing:
        return [Check("visibility_new", Status.FAIL, f"directory made on {a} not visible on "
                      f"the peer after {deadline_s:g}s")]

    # New files: B has listed the directory and looked the name up (negative) beforehand.
    listed: dict[str, float] = {}
    read: dict[str, float] = {}
    late: list[str] = []
    for i in range(samples):
        name, data = f"new.{i}", _frame(os.urandom(512))
        os.listdir(vis_b)
        _exists(os.path.join(vis_b, name))
        _publish(a, f"vis/{name}", data)
        t0 = time.perf_counter()
        got_l, miss_l = _poll({name: t0}, lambda n: n in os.listdir(vis_b), deadline_s)
        got_r, miss_r = _poll({name: t0}, functools.partial(_reads_in, vis_b, data),
                              deadline_s)
        listed.update(got_l)
        read.update(got_r)
        late += miss_l + miss_r
    check = _window_check("visibility_new", "a file published on the mount, listed and read "
                          "intact on the peer", read, sorted(set(late)), "visible_new",
                          deadline_s)
    check.measured.update({f"visible_new_list_{k[len('visible_new_'):]}": v
                           for k, v in _percentiles("visible_new", list(listed.values())).items()})
    checks.append(check)

    # Deleted names: B reads each file (warm entry and attribute caches) right before A
    # deletes it; a watcher thread polls B while A works through the batch.
    vis_a = os.path.join(a, "vis")

    def delete(name: str) -> None:
        _reads(os.path.join(vis_b, name), b"")
        os.unlink(os.path.join(vis_a, name))

    gone, missing = _mutate_and_watch([f"new.{i}" for i in range(samples)], delete,
                                      lambda n: not _exists(os.path.join(vis_b, n)), deadline_s)
    still_listed = sorted(set(gone) & set(os.listdir(vis_b)))
    check = _window_check("visibility_delete", "a name deleted on the mount, gone on the "
                          "peer", gone, missing, "visible_delete", deadline_s)
    if still_listed:
        check = Check(check.name, Status.FAIL, f"{check.detail}; but still listed on the peer "
                      f"after stat said gone: {still_listed[:3]}", check.measured)
    checks.append(check)

    # Replaced files (the queue never does this; it measures the metadata-cache staleness).
    old = _frame(b"old" * 100)
    new_data = {f"rep.{i}": _frame(os.urandom(300)) for i in range(samples)}
    for name in new_data:
        _publish(a, f"vis/{name}", old)
    _poll(dict.fromkeys(new_data, 0.0), lambda n: _reads(os.path.join(vis_b, n), old),
          deadline_s)

    def replace(name: str) -> None:
        _reads(os.path.join(vis_b, name), b"")  # B warms its caches right before the swap
        _publish(a, f"vis/{name}", new_data[name])

    fresh, missing = _mutate_and_watch(list(new_data), replace,
                                       lambda n: _reads(os.path.join(vis_b, n), new_data[n]),
                                       deadline_s)
    checks.append(_window_check("visibility_replace", "a file replaced by rename on the mount: "
                                "stale window on the peer (metadata-cache staleness)", fresh,
                                missing, "stale_replace", deadline_s))
    return checks


def _mutate_and_watch(names: Sequence[str], mutate: Callable[[str], None],
                      probe: Callable[[str], bool], deadline_s: float
                      ) -> tuple[dict[str, float], list[str]]:
    """Apply ``mutate`` to each name in turn while a thread polls ``probe`` for each one
    already mutated; the delay of a name runs from the end of its mutation.

    Watching concurrently keeps a batch of samples from adding its own length to every
    window (sequential samples would cost a full cache TTL each).
    """
    lock = threading.Lock()
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    mutated = threading.Event()

    def watch() -> None:
        end = None
        while end is None or time.perf_counter() < end:
            if end is None and mutated.is_set():
                end = time.perf_counter() + deadline_s
            with lock:
                todo = [(n, t) for n, t in started.items() if n not in done]
            if mutated.is_set() and not todo:
                return
            for name, t0 in todo:
                if probe(name):
                    done[name] = max(0.0, time.perf_counter() - t0)
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, name="strawq-doctor-watch", daemon=True)
    watcher.start()
    try:
        for name in names:
            mutate(name)
            with lock:
                started[name] = time.perf_counter()
    finally:
        mutated.set()
        watcher.join(deadline_s + 5)
    return dict(done), sorted(set(names) - set(done))


def _torn_check(scratch: str, reader_dir: str, files: int, size: int, ctx: Any,
                deadline_s: float) -> Check:
    """Publish ``files`` records while another process (on the peer, if any) reads them."""
    os.makedirs(os.path.join(scratch, "pub"))
    _fsync_dir(scratch)
    _, missing = _poll({"pub": time.perf_counter()}, lambda _: os.path.isdir(reader_dir),
                       deadline_s)
    if missing:
        return Check("publish_no_torn", Status.FAIL, f"{reader_dir} never appeared")
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_torn_reader, name="strawq-doctor-reader", daemon=True,
                         args=(reader_dir, files, deadline_s + files, ready, stop, results))
    reader.start()
    try:
        if not ready.wait(deadline_s + 30):
            return Check("publish_no_torn", Status.FAIL, "the reader process did not start")
        for i in range(files):
            _publish(scratch, f"pub/r{i}", _frame(os.urandom(size)))
        _publish(scratch, "pub/done", b"done")
        try:
            seen, torn = results.get(timeout=deadline_s + files + 30)
        except queue.Empty:
            return Check("publish_no_torn", Status.FAIL, "the reader process did not report")
    finally:
        stop.set()  # a publish failed (ENOSPC...) or all is read: the reader ends now
        reader.join(timeout=5)
        if reader.is_alive():
            reader.terminate()
    measured = {"publish_files": float(files), "publish_torn_reads": float(len(torn)),
                "publish_bytes": float(size)}
    what = (f"{files} records of {size // 1024} KiB published by tmp+fsync+close+rename, "
            "read concurrently by another process")
    if torn:
        return Check("publish_no_torn", Status.FAIL, f"{what}: {len(torn)} torn reads, e.g. "
                     f"{torn[0]}", measured)
    if seen < files:
        return Check("publish_no_torn", Status.FAIL, f"{what}: the reader saw only {seen} of "
                     f"{files} within {deadline_s:g}s", measured)
    return Check("publish_no_torn", Status.PASS, f"{what}: every read whole", measured)


def _fsync_checks(scratch: str) -> list[Check]:
    checks: list[Check] = []
    path = os.path.join(scratch, "fsync-probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, os.urandom(64 * 1024))
            t0 = time.perf_counter()
            os.fsync(fd)
            took = time.perf_counter() - t0
            os.fdatasync(fd)
        finally:
            os.close(fd)
        checks.append(Check("fsync_file", Status.PASS, f"fsync of a 64 KiB file: "
                            f"{took * 1e3:.2f} ms", {"fsync_file_s": took}))
    except OSError as exc:
        checks.append(Check("fsync_file", Status.FAIL, f"fsync of a file failed: "
                            f"{_errname(exc)} {exc.strerror}; nothing published here would "
                            "be durable"))
    try:
        t0 = time.perf_counter()
        _fsync_dir(scratch)
        took = time.perf_counter() - t0
        checks.append(Check("fsync_dir", Status.PASS, f"fsync of a directory: "
                            f"{took * 1e3:.2f} ms", {"fsync_dir": 1.0, "fsync_dir_s": took}))
    except OSError as exc:
        status = Status.WARN if exc.errno == errno.EINVAL else Status.FAIL
        checks.append(Check("fsync_dir", status, f"fsync of a directory failed: "
                            f"{_errname(exc)}; a crash right after a rename may lose it",
                            {"fsync_dir": 0.0}))
    return checks


def _noreplace_probe(scratch: str) -> Check:
    a, b = os.path.join(scratch, "nr-probe-a"), os.path.join(scratch, "nr-probe-b")
    for p, body in ((a, b"a"), (b, b"b")):
        with open(p, "wb") as f:
            f.write(body)
    try:
        _renameat2_noreplace(a, b)
    except OSError as exc:
        if exc.errno == errno.EEXIST and _read_small(b) == "b" and os.path.exists(a):
            return Check("rename_noreplace", Status.PASS, "renameat2(RENAME_NOREPLACE) "
                         "refuses an existing target (EEXIST), target unchanged",
                         {"rename_noreplace": 1.0})
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            return Check("rename_noreplace", Status.WARN, f"renameat2(RENAME_NOREPLACE) is "
                         f"unsupported ({_errname(exc)}): PosixStorage falls back to "
                         "check-then-rename, so two writers publishing the same key could "
                         "both succeed (the queue's keys are unique by construction)",
                         {"rename_noreplace": 0.0})
        return Check("rename_noreplace", Status.FAIL, f"renameat2(RENAME_NOREPLACE) failed "
                     f"with {_errname(exc)} {exc.strerror}", {"rename_noreplace": 0.0})
    return Check("rename_noreplace", Status.FAIL, "renameat2(RENAME_NOREPLACE) replaced an "
                 f"existing file (target now holds {_read_small(b)!r}): exclusive publish is "
                 "broken on this filesystem", {"rename_noreplace": 0.0})


def _fs_check(mount: MountInfo) -> Check:
    where = f"{mount.fs_type} mounted at {mount.mount_point} from {mount.source}"
    t = mount.fs_type
    if t in _OBJECT_STORE_FUSE:
        return Check("filesystem", Status.FAIL, f"{where}: an object-store FUSE (rename is "
                     "copy+delete, not atomic; no exclusive create); use a POSIX mount such as "
                     "'juicefs mount'")
    if t in _NFS_TYPES:
        if "nocto" in mount.super_options or "nocto" in mount.mount_options:
            return Check("filesystem", Status.FAIL, f"{where}: 'nocto' disables close-to-open; "
                         "readers could see unflushed data; remount without nocto")
        return Check("filesystem", Status.WARN, f"{where}: NFS is not exercised by strawq's "
                     "test suite; new names can take up to acdirmax (60 s default) to appear "
                     "on other clients")
    if t.startswith("fuse.juicefs") or t in _LOCAL_TYPES:
        return Check("filesystem", Status.PASS, where)
    if t == "overlay":
        return Check("filesystem", Status.WARN, f"{where}: a container's overlay layer; data "
                     "vanishes with the container, and directory renames can fail with EXDEV; "
                     "mount a volume for the queue")
    return Check("filesystem", Status.WARN, f"{where}: a filesystem strawq does not know; "
                 "rely on the measured checks below")


_BASE_DURABILITY = {
    "local": "local filesystem: durable after fsync of the file and its directory",
    "nfs": "NFS: durability is the server's (a 'sync' export is expected); not verified here",
}


def _direct_mount(mount: MountInfo) -> bool | None:
    if mount.fs_type.startswith("fuse.juicefs") or mount.fs_type in _LOCAL_TYPES:
        return True
    if mount.fs_type in _OBJECT_STORE_FUSE:
        return False
    return None


def _unreachable(path: str) -> str | None:
    """Why ``path`` cannot be reached (not merely absent), or None."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return (f"cannot stat {path}: {_errname(exc)} {exc.strerror}: the mount is not "
                "answering (a dead FUSE daemon, a stale NFS handle); remount it")
    return None


def run_doctor(path: str, *, peer: str | None = None, rounds: int = 20,
               processes: int = 8, quick: bool = False,
               declaration: Mapping[str, Any] | None = None,
               visibility_deadline_s: float | None = None, publish_size: int = 1 << 20,
               mp_context: str = "spawn") -> DoctorReport:
    """Measure the filesystem behaviours the queue relies on, at ``path``.

    ``peer`` is the same directory seen through a second client of the same volume (another
    JuiceFS mount); with it, races alternate between the two clients and cross-client
    visibility is measured. ``quick`` (start-up use) runs 3 rounds with 4 processes and
    small records. ``declaration`` (a loaded storage declaration) adds a ``declaration``
    check listing every mismatch. Work happens in ``path/.strawq-doctor-<uuid>/``, removed
    afterwards; ``ConfigError`` if ``path`` is not a directory.
    """
    unreachable = _unreachable(path)
    if unreachable is None and not os.path.isdir(path):
        raise ConfigError(f"doctor: {path!r} is not a directory: expected a directory on the "
                          "mount to verify (create it first)")
    if peer is not None and not os.path.isdir(peer):
        raise ConfigError(f"doctor: peer {peer!r} is not a directory: expected the same "
                          "directory seen through a second client of the volume")
    if rounds < 1 or processes < 2:
        raise ConfigError(f"doctor: rounds={rounds}, processes={processes}: expected "
                          "rounds >= 1 and processes >= 2")
    if quick:
        rounds, processes, publish_size = min(rounds, 3), min(processes, 4), min(publish_size,
                                                                                256 * 1024)
    started = time.monotonic()
    mount = find_mount(path)
    profile = _profile(mount.fs_type)
    deadline = visibility_deadline_s or (90.0 if profile == "nfs" else 10.0)
    ctx = multiprocessing.get_context(mp_context)
    report = DoctorReport(
        path=os.path.abspath(path), peer=os.path.abspath(peer) if peer else None, mount=mount,
        profile=profile, checks=[_fs_check(mount)], juicefs=None, client_version=None,
        durability_description=_BASE_DURABILITY.get(profile, ""),
        direct_mount=_direct_mount(mount),
        started_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        quick=quick)
    if unreachable is not None:  # a dead FUSE daemon, a stale NFS handle...
        report.checks.append(Check("reachable", Status.FAIL, unreachable))
        report.elapsed_s = time.monotonic() - started
        return report
    if profile == "juicefs":
        settings, argv = juicefs_settings(mount.mount_point)
        binary_version = _binary_version(argv) if argv or settings.version is None else None
        jchecks, report.durability_description = _juicefs_checks(settings, binary_version)
        report.juicefs = settings
        report.client_version = settings.version or binary_version
        report.checks += jchecks

    scratch_name = f"{SCRATCH_PREFIX}{uuid.uuid4().hex[:12]}"
    scratch = os.path.join(path, scratch_name)
    try:
        os.mkdir(scratch)
        os.mkdir(os.path.join(scratch, "tmp"))
        _fsync_dir(path)
    except OSError as exc:
        report.checks.append(Check("scratch", Status.FAIL, f"cannot create {scratch}: "
                                   f"{_errname(exc)} {exc.strerror} (read-only or full mount, "
                                   "or no write permission); nothing else could be measured"))
        report.elapsed_s = time.monotonic() - started
        return report
    report.checks.append(Check("scratch", Status.PASS, f"created {scratch}"))
    try:
        _measure(report, scratch, peer, scratch_name, rounds, processes, publish_size,
                 deadline, ctx)
    except OSError as exc:  # ENOSPC, EIO, ESTALE...: the mount failed, not the doctor
        report.checks.append(Check("measurement", Status.FAIL, f"aborted by {_errname(exc)} "
                                   f"{exc.strerror} on {exc.filename or path}: the mount "
                                   "cannot hold the queue as it is (full, read-only or "
                                   "failing); the checks above are incomplete"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.lexists(scratch):
            log.warning("could not remove the doctor's scratch directory %s; remove it by hand",
                        scratch)
    if declaration is not None:
        mismatches = compare_declaration(declaration, report)
        report.checks.append(Check(
            "declaration", Status.FAIL if mismatches else Status.PASS,
            "; ".join(mismatches) if mismatches else "the mount matches the storage declaration"))
    report.elapsed_s = time.monotonic() - started
    log.info("doctor %s: %s in %.1fs", path, "ok" if report.ok else "FAILED", report.elapsed_s)
    return report


def _measure(report: DoctorReport, scratch: str, peer: str | None, scratch_name: str,
             rounds: int, processes: int, publish_size: int, deadline: float, ctx: Any) -> None:
    checks = report.checks
    checks += _fsync_checks(scratch)
    noreplace = _noreplace_probe(scratch)
    checks.append(noreplace)

    dirs = [scratch]
    peer_scratch = None
    if peer is not None:
        peer_scratch = os.path.join(peer, scratch_name)
        seen, _ = _poll({"scratch": time.perf_counter()},
                        lambda _: os.path.isdir(peer_scratch or ""), deadline)
        if not seen:
            checks.append(Check("peer_volume", Status.FAIL, f"{peer_scratch} did not appear "
                                f"within {deadline:g}s after creating {scratch}: the peer is "
                                "not the same directory of the same volume"))
            peer_scratch = None
        else:
            same = os.stat(scratch).st_dev == os.stat(peer_scratch).st_dev
            checks.append(Check(
                "peer_volume", Status.WARN if same else Status.PASS,
                ("the peer is the same mount as the path (same device): cross-client numbers "
                 "describe one client only" if same else "the peer is a second client of the "
                 "same volume") + f"; scratch dir seen there after "
                f"{seen['scratch'] * 1e3:.1f} ms", {"peer_first_visible_s": seen["scratch"]}))
            dirs.append(peer_scratch)

    kinds = ["rename", "excl"] + (["noreplace"] if noreplace.status is Status.PASS else [])
    for rnd in range(rounds):
        with open(os.path.join(scratch, f"ren.{rnd}"), "wb") as f:
            f.write(b"claim me")
            os.fsync(f.fileno())
    _fsync_dir(scratch)
    if peer_scratch is not None:  # racers on the peer must see the sources before racing
        _poll({f"ren.{r}": 0.0 for r in range(rounds)},
              lambda n: _exists(os.path.join(peer_scratch or "", n)), deadline)
    where = " across two clients" if len(dirs) > 1 else ""
    try:
        table, errors = _run_races(dirs, rounds, processes, kinds, ctx, deadline_s=60.0)
    except OSError as exc:  # e.g. cannot start processes
        checks.append(Check("races", Status.FAIL, f"could not run the racing processes: {exc}"))
        table, errors = {}, []
    post = _race_postconditions(scratch, table)
    names = {"rename": ("atomic_rename", f"rename(src -> own dst){where}", ["ENOENT"]),
             "excl": ("exclusive_create", f"open(O_CREAT|O_EXCL){where}", ["EEXIST"]),
             "noreplace": ("noreplace_publish",
                           f"renameat2(RENAME_NOREPLACE) onto one name{where}",
                           ["EEXIST", "ENOENT"])}
    for kind, rows in table.items():
        name, what, losers = names[kind]
        checks.append(judge_race(name, what, rows, losers, errors + post[kind]))

    reader_dir = os.path.join(peer_scratch or scratch, "pub")
    checks.append(_torn_check(scratch, reader_dir, rounds, publish_size, ctx, deadline))

    if peer_scratch is not None:
        checks += _visibility_checks(scratch, peer_scratch, min(rounds, 20), deadline)
    else:
        checks.append(Check("visibility", Status.SKIP, "no peer mount given: cross-client "
                            "visibility not measured (pass --peer with a second client's "
                            "path to the same directory)"))


# -- storage declarations ------------------------------------------------------------------

DECLARATION_KEYS = ("profile", "direct_mount", "writeback", "open_cache", "readdir_cache",
                    "client_version", "durability_description", "measured", "verified_at",
                    "mount", "fs_type")
_PROFILES = ("local", "juicefs", "nfs")
#: measured capabilities (1 = present) that must match exactly
_EXACT_MEASURES = ("rename_noreplace", "fsync_dir")
#: a fresh window/latency (``*_s``) mismatches when above declared * factor + slack
WINDOW_FACTOR, WINDOW_SLACK_S = 4.0, 0.5


def declaration_from_report(report: DoctorReport) -> dict[str, Any]:
    """The storage declaration a report supports (see ``DECLARATION_KEYS``)."""
    j = report.juicefs
    return {
        "profile": report.profile,
        "direct_mount": report.direct_mount,
        "writeback": j.writeback if j else None,
        "open_cache": j.open_cache_s if j else None,
        "readdir_cache": j.readdir_cache if j else None,
        "client_version": report.client_version,
        "durability_description": report.durability_description,
        "measured": {k: round(v, 6) for k, v in sorted(report.measured().items())},
        "verified_at": report.started_at,
        "mount": report.mount.mount_point,
        "fs_type": report.mount.fs_type,
    }


def write_declaration(report: DoctorReport, path: str) -> dict[str, Any]:
    """Write the declaration of ``report`` to ``path`` (JSON, atomically); return it."""
    if not report.ok:
        failed = ", ".join(c.name for c in report.failed())
        raise DoctorFailed(f"refusing to declare {report.path}: checks failed ({failed}); "
                           "fix the mount and run doctor again")
    decl = declaration_from_report(report)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(decl, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise ConfigError(f"cannot write the storage declaration {path}: {exc}") from exc
    return decl


def load_declaration(path: str) -> dict[str, Any]:
    """Read and validate a declaration; ``ConfigError`` names any unknown or missing key."""
    try:
        with open(path, encoding="utf-8") as f:
            decl = json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the storage declaration {path}: {exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"storage declaration {path} is not valid JSON: {exc}") from exc
    if not isinstance(decl, dict):
        raise ConfigError(f"storage declaration {path}: expected a JSON object, found "
                          f"{type(decl).__name__}")
    unknown = sorted(set(decl) - set(DECLARATION_KEYS))
    if unknown:
        raise ConfigError(f"storage declaration {path}: unknown key(s) {unknown}; expected "
                          f"only {list(DECLARATION_KEYS)} (regenerate it with 'strawq doctor "
                          "PATH --write-declaration FILE')")
    missing = [k for k in DECLARATION_KEYS if k not in decl]
    if missing:
        raise ConfigError(f"storage declaration {path}: missing key(s) {missing}; regenerate "
                          "it with 'strawq doctor PATH --write-declaration FILE'")
    if decl["profile"] not in _PROFILES:
        raise ConfigError(f"storage declaration {path}: profile {decl['profile']!r}, expected "
                          f"one of {list(_PROFILES)}")
    measured = decl["measured"]
    if not isinstance(measured, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in measured.values()):
        raise ConfigError(f"storage declaration {path}: 'measured' must map names to numbers")
    return decl


def compare_declaration(decl: Mapping[str, Any], report: DoctorReport) -> list[str]:
    """Every way a fresh report disagrees with a declaration (empty: it matches)."""
    fresh = declaration_from_report(report)
    out: list[str] = []
    for key in ("profile", "fs_type", "mount", "direct_mount", "writeback", "open_cache",
                "readdir_cache", "client_version", "durability_description"):
        if decl.get(key) != fresh[key]:
            out.append(f"{key}: declared {decl.get(key)!r}, found {fresh[key]!r}")
    declared = decl.get("measured") or {}
    now = fresh["measured"]
    for key, value in sorted(declared.items()):
        if key not in now:
            continue  # not re-measured this time (e.g. quick mode without a peer)
        if key in _EXACT_MEASURES and now[key] != value:
            out.append(f"measured {key}: declared {value:g}, found {now[key]:g}")
        elif key.endswith("_s") and now[key] > value * WINDOW_FACTOR + WINDOW_SLACK_S:
            out.append(f"measured {key}: declared {value:.4f}s, found {now[key]:.4f}s (more "
                       f"than {WINDOW_FACTOR:g}x + {WINDOW_SLACK_S:g}s worse)")
    return out


def check_declaration(decl_path: str, report: DoctorReport) -> list[str]:
    """Load the declaration at ``decl_path`` and list its mismatches with ``report``."""
    return compare_declaration(load_declaration(decl_path), report)


def require_healthy(path: str, declaration_path: str | None = None, *,
                    peer: str | None = None, mp_context: str = "spawn") -> DoctorReport:
    """Start-up gate: a quick doctor run; ``DoctorFailed`` lists every failed check.

    With ``declaration_path`` the mount must also match that storage declaration.
    Takes about a second on a local disk or JuiceFS (process start-up dominates).
    """
    declaration = load_declaration(declaration_path) if declaration_path else None
    report = run_doctor(path, peer=peer, quick=True, declaration=declaration,
                        mp_context=mp_context)
    failed = report.failed()
    if failed:
        lines = "\n".join(f"  - {c.name}: {c.detail}" for c in failed)
        raise DoctorFailed(f"the mount at {path} ({report.mount.fs_type} on "
                           f"{report.mount.mount_point}) failed {len(failed)} check(s):\n"
                           f"{lines}\nRun 'strawq doctor {path}' for the full report; fix the "
                           "mount (or regenerate its declaration) before starting a run.")
    return report
