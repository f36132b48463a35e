"""Fixtures of the core tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.storage import MemoryStorage, PosixStorage, Storage


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh run store on each backend: in memory and on the local disk."""
    if request.param == "memory":
        return MemoryStorage()
    return PosixStorage(str(tmp_path / "run"))
