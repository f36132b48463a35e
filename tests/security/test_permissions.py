"""A run directory gives others no access; its group gets what the umask leaves it
(docs/security.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from strawq.storage.posix import PosixStorage

REPO = Path(__file__).resolve().parents[2]


def _modes(root: Path) -> dict[str, int]:
    found = {str(root): stat.S_IMODE(os.stat(root).st_mode)}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            found[p] = stat.S_IMODE(os.stat(p).st_mode)
    return found


def _init_and_write(path: Path, umask: int) -> None:
    code = ("import os, sys; os.umask(int(sys.argv[1], 8)); from strawq.app.cli import main; "
            "rc = main(['-q', 'init', sys.argv[2]]); "
            "from strawq.storage.posix import PosixStorage; "
            "PosixStorage(sys.argv[2]).publish('data/deep/x.bin', b'1'); sys.exit(rc)")
    subprocess.run([sys.executable, "-c", code, oct(umask)[2:], str(path)], check=True,
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


@pytest.mark.parametrize("umask, dir_mode, file_mode", [
    (0o022, 0o750, 0o640),  # the usual default: group may read
    (0o007, 0o770, 0o660),  # a run shared by a group of users
    (0o000, 0o770, 0o660),  # even no umask leaves others out
])
@pytest.mark.process
def test_init_and_publish_give_others_nothing(tmp_path: Path, umask: int, dir_mode: int,
                                             file_mode: int) -> None:
    run = tmp_path / "new" / "run"  # a missing parent is created the same way
    _init_and_write(run, umask)
    modes = _modes(tmp_path / "new")
    assert len(modes) > 4
    for p, mode in modes.items():
        want = dir_mode if os.path.isdir(p) else file_mode
        assert mode == want, f"{p}: {oct(mode)}, expected {oct(want)}"


def test_makedirs_creates_every_level_without_access_for_others(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        s = PosixStorage(str(tmp_path))
        s.makedirs("a/b/c")
    finally:
        os.umask(old)
    for rel in ("a", "a/b", "a/b/c"):
        assert stat.S_IMODE(os.stat(tmp_path / rel).st_mode) == 0o770, rel


def test_the_config_files_cluster_up_writes_are_owner_only(tmp_path: Path) -> None:
    from strawq.app.cluster import _write
    from strawq.producers.engine_transport import ClientConfig

    old = os.umask(0o002)
    try:
        path = _write(str(tmp_path / "producer.json"), ClientConfig(api_key="k"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
