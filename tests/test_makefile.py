"""The Makefile: ``make torch`` keeps an installed torch, else lets pip's configuration
decide (one documented variable, ``TORCH_INDEX``, adds PyTorch's CPU wheel index); no
package index is written into the Makefile's commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

FAKE_PYTHON = """#!/bin/sh
# stands in for the venv's python: `-c "import torch"` answers TORCH_PRESENT, pip is recorded
if [ "$1" = "-c" ]; then [ -n "$TORCH_PRESENT" ] && { echo 2.13.0+cpu; exit 0; }; exit 1; fi
echo "$@" >> "$(dirname "$0")/pip.log"
"""


def _make_torch(tmp_path: Path, *args: str, torch_present: bool = False) -> tuple[str, str]:
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX", "MAKEFLAGS")}
    if torch_present:
        env["TORCH_PRESENT"] = "1"
    res = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "torch",
                          f"PY={py}", *args], capture_output=True, text=True, env=env,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    log = tmp_path / "pip.log"
    return (log.read_text() if log.exists() else ""), res.stdout


@pytest.mark.process
def test_by_default_pip_configuration_decides(tmp_path: Path) -> None:
    log, _ = _make_torch(tmp_path)
    assert "install -q torch==" in log
    assert "index-url" not in log


@pytest.mark.process
def test_torch_index_is_added_beside_the_configured_index(tmp_path: Path) -> None:
    log, _ = _make_torch(tmp_path, "TORCH_INDEX=https://example.invalid/whl/cpu")
    assert "--extra-index-url https://example.invalid/whl/cpu" in log
    assert "--index-url" not in log.replace("--extra-index-url", "")


@pytest.mark.process
def test_an_installed_torch_is_kept(tmp_path: Path) -> None:
    log, out = _make_torch(tmp_path, "TORCH_INDEX=https://example.invalid/whl/cpu",
                           torch_present=True)
    assert log == ""
    assert "using the installed" in out


def test_no_package_index_in_the_makefile_commands() -> None:
    """Comments may show an index as an example; recipes and defaults name none."""
    for n, line in enumerate((REPO / "Makefile").read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        for marker in ("pypi.org", "download.pytorch.org", "--index-url https", "/simple"):
            assert marker not in code, f"Makefile:{n} names a package index: {line.strip()}"
