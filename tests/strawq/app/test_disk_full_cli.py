"""``strawq release`` on a full disk: one line in words, exit 1, nothing released; once
space returns the same command releases the prompts, and the half-staged release is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from tests.small_disk import SmallDisk, small_disk  # noqa: F401 - the fixture


def _strawq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "strawq", *args], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.process
def test_release_on_a_full_disk_fails_in_one_line_and_works_once_space_returns(
        small_disk: SmallDisk, tmp_path: Path) -> None:  # noqa: F811
    run = os.path.join(small_disk.path, "run")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [1, 2, i]}) + "\n" for i in range(6)))
    assert _strawq("init", run, "-q").returncode == 0
    small_disk.fill()
    proc = _strawq("release", run, str(data), "--count", "6", "-q")
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "Errno" not in lines[0] and "No space left on device" in lines[0]
    assert "free space" in lines[0]
    q = RunQueue.open(open_storage(run, read_only=True))
    assert q.list_pending() == []
    small_disk.free()
    proc = _strawq("release", run, str(data), "--count", "6", "-q")
    assert proc.returncode == 0, proc.stderr
    assert len(q.list_pending()) == 6
    assert [n for n in q.storage.list("staging")] == [] and q.storage.list("tmp") == []
