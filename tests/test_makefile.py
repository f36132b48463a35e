"""`make torch`: an installed torch is kept, a local wheel folder is used, else the CPU index."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
# stands in for the venv's python: no torch, no pip config, pip install is recorded
if [ "$1" = "-c" ]; then exit 1; fi
if [ "$3" = "config" ]; then exit 0; fi
echo "$@" >> "$(dirname "$0")/pip.log"
"""


def _make_torch(tmp_path: Path, find_links: str) -> str:
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    env = {**os.environ, "PIP_FIND_LINKS": find_links}
    res = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "torch",
                          f"PY={py}"], capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert res.returncode == 0, res.stderr
    return (tmp_path / "pip.log").read_text()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_without_a_local_wheel_the_cpu_index_is_asked_explicitly(tmp_path: Path) -> None:
    log = _make_torch(tmp_path, str(tmp_path / "no-such-folder"))
    assert "--index-url https://download.pytorch.org/whl/cpu" in log
    assert "--extra-index-url https://pypi.org/simple" in log


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_local_wheel_folder_is_used_as_configured(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    log = _make_torch(tmp_path, str(wheels))
    assert "--index-url" not in log and "install -q torch==" in log
