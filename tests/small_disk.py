"""A real, size-limited filesystem that a test can fill and free: a small tmpfs.

``small_disk`` (function fixture): a ``SmallDisk`` on a fresh 2 MiB tmpfs, unmounted (lazily)
after the test. ``fill()`` writes a ballast file until the filesystem reports ENOSPC;
``free()`` removes it. Mounting needs root or CAP_SYS_ADMIN: without it the test skips,
saying why.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["SmallDisk", "small_disk"]


class SmallDisk:
    """A mounted tmpfs at ``path`` with a ballast file to make it full."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ballast = os.path.join(path, "ballast")

    def fill(self) -> int:
        """Write ballast until ENOSPC; returns the bytes written. The ballast's name is a
        dot-free top-level file, outside every directory the queue lists."""
        chunk = b"\0" * 4096
        written = 0
        with open(self.ballast, "ab", buffering=0) as f:
            while True:
                try:
                    written += f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        return written

    def free(self) -> None:
        os.unlink(self.ballast)

    def shrink_ballast(self, nbytes: int) -> None:
        """Give ``nbytes`` back: the filesystem is then nearly, not quite, full."""
        size = os.path.getsize(self.ballast)
        os.truncate(self.ballast, max(0, size - nbytes))

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs",
                           str(mnt)], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{proc.stderr.strip() or 'mount failed'}")
    try:
        yield SmallDisk(str(mnt))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
