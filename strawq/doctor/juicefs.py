"""What a JuiceFS client is running with, and whether those settings keep the queue safe.

Mount options can silently break the guarantees the queue measures (``--writeback`` loses
published records with a cache disk, ``--open-cache`` breaks close-to-open), and some
settings cannot be measured at all (the metadata engine's durability), so they are read
from the client itself: ``.config`` at the mount root, and the ``juicefs mount`` process's
command line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from strawq.doctor.report import Check, JuiceFSSettings, Status

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


#: metadata URL schemes that name another scheme's engine (``unix://``: Redis on a socket)
_ENGINE_OF_SCHEME = {"rediss": "redis", "unix": "redis", "postgresql": "postgres",
                     "sqlite": "sqlite3"}


def meta_engine(meta_url: str) -> str:
    """The metadata engine a JuiceFS metadata URL names: redis, sqlite3, tikv, mysql, ..."""
    scheme = _meta_scheme(meta_url)
    return _ENGINE_OF_SCHEME.get(scheme, scheme)


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

    if pid_hint:  # the pid the mount's own .config names: its argv may be truncated
        argv = _read_cmdline(pid_hint)
        if matches(argv) or (argv and "juicefs" in os.path.basename(argv[0])
                             and parse_juicefs_cmdline(argv)[0][:1] == ["mount"]):
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


#: where ``juicefs mount`` logs without ``--log``: root's default, then a user's
_DEFAULT_LOGS = ("/var/log/juicefs.log", os.path.expanduser("~/.juicefs/juicefs.log"))
_LOG_TAIL_BYTES = 4 << 20


def _meta_url_from_log(opts: dict[str, str | bool], pid: int) -> str | None:
    """The metadata URL the client ``pid`` logged at start (``Meta address: URL``).

    A daemonised ``juicefs mount -d`` rewrites its own command line, truncated to the
    original's length: a long cache or log path cuts the metadata URL off, while the log
    line carries it whole."""
    log = opts.get("--log")
    pattern = re.compile(rf"juicefs\[{pid}\] <INFO>: Meta address: (\S+)")
    for path in ((log,) if isinstance(log, str) else _DEFAULT_LOGS):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - _LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        found = pattern.findall(text)
        if found:
            return str(found[-1])
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
        subcommand = pos[0]
        meta_url = pos[1] if len(pos) >= 3 else None
        logged = _meta_url_from_log(opts, pid) if isinstance(pid, int) else None
        if logged is not None:
            meta_url = logged
        elif meta_url is None and len(pos) == 2 and "://" in pos[1]:
            meta_url = pos[1]  # the URL, its tail cut off with the mount point: scheme kept

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
        "meta_engine": meta_engine(meta_url) if meta_url else None,
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
        out = subprocess.run([binary, "version"], check=False, capture_output=True, text=True,
                             timeout=10)
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
    if s.meta_engine is None:
        checks.append(Check("juicefs_meta_engine", Status.WARN,
                            "metadata engine unknown: .config does not name it and the "
                            "juicefs mount process's command line is not readable; run "
                            "doctor as the mount's user"))
    else:
        checks.append(Check("juicefs_meta_engine", Status.PASS,
                            f"metadata engine {s.meta_engine} ({s.meta_scheme}:// on the "
                            f"juicefs mount command line) [{s.meta_url}]"))
    if s.meta_scheme is None:
        durability = "metadata engine unknown (the mount's command line is not readable)"
        checks.append(Check("juicefs_durability", Status.WARN, durability))
    else:
        status, durability = _DURABILITY.get(
            s.meta_scheme, (Status.WARN, f"{s.meta_scheme} metadata: durability not assessed"))
        checks.append(Check("juicefs_durability", status, f"{durability} [{s.meta_url}]"))
    return checks, durability
