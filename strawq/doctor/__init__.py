"""``strawq doctor``: verify a mount by measuring it, instead of trusting a declaration.

The queue relies on a handful of filesystem behaviours (``docs/filesystem-contract.md``,
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
(``strawq.app.doctor_cli`` renders reports).

Layout: this module runs the checks in order (``run_doctor``, ``require_healthy``);
``mounts`` finds the mount and its type, ``juicefs`` reads and judges a JuiceFS client's
settings, ``publish`` checks fsync, ``RENAME_NOREPLACE`` and torn publication, ``races``
runs the multi-process races, ``visibility`` measures the peer's lag, ``declaration``
saves and compares storage declarations; ``report`` holds the data types and
``primitives`` the file operations the checks share.
"""

from __future__ import annotations

import datetime as _dt
import logging
import multiprocessing
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import Any

from strawq.doctor.declaration import (
    DECLARATION_KEYS,
    WINDOW_FACTOR as WINDOW_FACTOR,
    WINDOW_SLACK_S as WINDOW_SLACK_S,
    check_declaration,
    compare_declaration,
    declaration_from_report,
    load_declaration,
    write_declaration,
)
from strawq.doctor.juicefs import (
    _binary_version,
    _juicefs_checks as _juicefs_checks,
    _parse_duration as _parse_duration,
    juicefs_settings as juicefs_settings,
    meta_engine as meta_engine,
    parse_juicefs_cmdline as parse_juicefs_cmdline,
    redact_url as redact_url,
)
from strawq.doctor.mounts import (
    _BASE_DURABILITY,
    _direct_mount,
    _fs_check as _fs_check,
    _profile,
    _unreachable as _unreachable,
    find_mount,
)
from strawq.doctor.primitives import (
    _errname,
    _frame as _frame,
    _fsync_dir,
    _intact as _intact,
)
from strawq.doctor.publish import _fsync_checks, _noreplace_probe, _torn_check
from strawq.doctor.races import _race_checks, judge_race
from strawq.doctor.report import Check, DoctorReport, JuiceFSSettings, MountInfo, Status
from strawq.doctor.visibility import (
    STALE_WARN_S as STALE_WARN_S,
    _peer_volume,
    _visibility_checks,
)
from strawq.errors import ConfigError, DoctorFailed

log = logging.getLogger(__name__)

# Also importable from here: the names above marked "as" (tests and callers use them) and
# everything in __all__.
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
    """Every measured check, in report order, inside the scratch directory."""
    checks = report.checks
    checks += _fsync_checks(scratch)
    noreplace = _noreplace_probe(scratch)
    checks.append(noreplace)

    peer_scratch = None
    if peer is not None:
        peer_check, peer_scratch = _peer_volume(scratch, os.path.join(peer, scratch_name),
                                                deadline)
        checks.append(peer_check)
    dirs = [scratch] if peer_scratch is None else [scratch, peer_scratch]

    kinds = ["rename", "excl"] + (["noreplace"] if noreplace.status is Status.PASS else [])
    checks += _race_checks(dirs, rounds, processes, kinds, ctx, deadline)

    reader_dir = os.path.join(peer_scratch or scratch, "pub")
    checks.append(_torn_check(scratch, reader_dir, rounds, publish_size, ctx, deadline))

    if peer_scratch is not None:
        checks += _visibility_checks(scratch, peer_scratch, min(rounds, 20), deadline)
    else:
        checks.append(Check("visibility", Status.SKIP, "no peer mount given: cross-client "
                            "visibility not measured (pass --peer with a second client's "
                            "path to the same directory)"))


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
