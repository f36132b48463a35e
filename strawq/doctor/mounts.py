"""Which mount holds a path, what kind of filesystem it is, and whether it answers.

Read from ``/proc/self/mountinfo`` rather than trusted from configuration: the mount type
decides the profile (local, NFS, JuiceFS), and an object-store FUSE fails before anything
is measured because its rename is copy+delete.
"""

from __future__ import annotations

import logging
import os
import re

from strawq.doctor.primitives import _errname
from strawq.doctor.report import Check, MountInfo, Status

log = logging.getLogger(__name__)

#: local-disk filesystem types (the "local" profile; also what verl's queue client writes on)
LOCAL_TYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs",
                         "ramfs", "bcachefs"})
_NFS_TYPES = {"nfs", "nfs4"}
_OBJECT_STORE_FUSE = {"fuse.s3fs", "fuse.goofys", "fuse.mountpoint-s3", "fuse.gcsfuse",
                      "fuse.rclone", "fuse.geesefs", "fuse.blobfuse", "fuse.blobfuse2",
                      "fuse.s3ql", "fuse.ossfs", "fuse.cosfs"}


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
    if t.startswith("fuse.juicefs") or t in LOCAL_TYPES:
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
    if mount.fs_type.startswith("fuse.juicefs") or mount.fs_type in LOCAL_TYPES:
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
