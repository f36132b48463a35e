"""Storage declarations: a healthy report saved as JSON, and checked against a fresh one.

A declaration records what a mount was verified to be (profile, JuiceFS options, measured
windows), so that a later start-up can refuse a mount that has since been remounted with
other options or grown slower, instead of trusting a hand-written description.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from typing import Any

from strawq.doctor.report import DoctorReport
from strawq.errors import ConfigError, DoctorFailed

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
