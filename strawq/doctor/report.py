"""The report's vocabulary: what a check found, and what the doctor saw of the mount.

Plain data only, so that every checking module (and ``strawq.app.doctor_cli``, which renders
reports) can import it without pulling in the checks themselves.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


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
    meta_engine: str | None = None  # redis, sqlite3, tikv, ... (the scheme's engine)
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
