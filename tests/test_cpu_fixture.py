"""The real-SGLang CPU fixture builder (``deploy/sglang/cpu_fixture.sh``) stays inside the
repository and says why it cannot build instead of failing ``make test``.

The build itself (minutes, ~7 GB) is exercised by the real tier: every ``sglang_real`` test
starts its server through ``cpu_fixture.sh serve``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "deploy" / "sglang" / "cpu_fixture.sh"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def _run(home: Path, *args: str, path_prefix: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FIXTURE_PYTHON"}
    env["SGLANG_CPU_HOME"] = str(home)
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}:{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(["bash", str(FIXTURE), *args], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


def _no_python311(tmp_path: Path) -> Path:
    """A PATH prefix on which ``python3.11`` and ``python3`` both report Python 3.10."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3.11", "python3"):
        fake = bin_dir / name
        fake.write_text("#!/bin/sh\necho 3.10\n")
        fake.chmod(0o755)
    return bin_dir


@pytest.mark.process
def test_the_repository_refers_to_nothing_beside_the_checkout() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=False)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    this = Path(__file__).resolve()
    for rel in tracked.stdout.split():
        path = REPO / rel
        if path.resolve() == this or not path.is_file() or path.suffix == ".png":
            continue
        if rel == ".ci/run":
            continue  # CI's own machines: a copy of the pinned slime source, used when present
        text = path.read_text(encoding="utf-8", errors="replace")
        for marker in ("../shared", "shared/tools", "shared/peers"):
            assert marker not in text, f"{rel} refers to {marker!r}, outside the checkout"


@pytest.mark.process
@needs_bash
def test_status_of_an_empty_cache_says_not_built(tmp_path: Path) -> None:
    res = _run(tmp_path / "cache", "status")
    assert res.returncode == 1
    assert "not built" in res.stdout


@pytest.mark.process
@needs_bash
def test_without_python_311_ensure_says_why_in_one_line_and_succeeds(tmp_path: Path) -> None:
    res = _run(tmp_path / "cache", "ensure", path_prefix=_no_python311(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "no CPython 3.11" in lines[0] and "skip" in lines[0]


@pytest.mark.process
@needs_bash
def test_without_python_311_build_refuses(tmp_path: Path) -> None:
    res = _run(tmp_path / "cache", "build", path_prefix=_no_python311(tmp_path))
    assert res.returncode == 1
    assert "cannot build here: no CPython 3.11" in res.stderr
    assert not (tmp_path / "cache" / "venv").exists()


@pytest.mark.process
@needs_bash
def test_serve_refuses_an_unbuilt_cache(tmp_path: Path) -> None:
    res = _run(tmp_path / "cache", "serve", "30999")
    assert res.returncode == 1
    assert "not built" in res.stderr
