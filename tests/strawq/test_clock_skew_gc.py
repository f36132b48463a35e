"""``strawq gc``'s temporary-file sweep and hosts whose clocks disagree.

A temporary file of another host is judged abandoned by its age, its mtime against this
host's clock. On JuiceFS the writing client stamps the mtime with its own clock, so a
writer whose clock runs behind makes a file it is still writing look old, one whose clock
runs ahead makes it look young: the grace must exceed any skew between hosts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue


def _run_with_foreign_tmp(tmp_path: Path) -> tuple[RunQueue, dict[str, Path]]:
    """A run whose tmp/ holds files of another host, stamped as its skewed clocks would."""
    run = tmp_path / "run"
    run.mkdir()
    q = RunQueue.create(PosixStorage(str(run), writer_id="setup", fsync=False),
                        QueueConfig(fsync=False))
    now = time.time()
    files = {}
    for what, mtime in (("behind", now - 600), ("ahead", now + 600),
                        ("abandoned", now - 7200)):
        path = run / "tmp" / f"p-{what}.otherhost-4242.0123456789abcdef"
        path.write_bytes(b"partly written")
        os.utime(path, (mtime, mtime))
        files[what] = path
    return q, files


def test_gc_keeps_the_files_of_hosts_ten_minutes_off_and_takes_the_abandoned_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, files = _run_with_foreign_tmp(tmp_path)
    assert cli_main(["gc", str(tmp_path / "run"), "--json"]) == 0
    assert '"tmp": 1' in capsys.readouterr().out
    assert files["behind"].exists() and files["ahead"].exists()
    assert not files["abandoned"].exists()


def test_a_tmp_grace_shorter_than_a_clock_skew_is_refused_and_removes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tmp-grace 300`` would take the file a host 10 minutes behind is still writing."""
    q, files = _run_with_foreign_tmp(tmp_path)
    with pytest.raises(SystemExit) as exited:  # a usage error: argparse exits 2
        cli_main(["gc", str(tmp_path / "run"), "--tmp-grace", "300"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "at least 900 s" in err and "clock" in err
    assert "Traceback" not in err
    assert all(f.exists() for f in files.values())  # nothing removed
    with pytest.raises(ValueError, match="clock runs 10 minutes behind"):
        q.storage.clean_dead_tmp(grace_s=300)
    assert files["behind"].exists()
