"""``bench/queue_ops.py --release-chunk K``: the strawq case releases in chunks of K tasks and
its producers claim K at a time, so claims take whole chunks (issue 40)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.process

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _queue_ops() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("queue_ops_bench", BENCH / "queue_ops.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("chunk", "chunked"), [(1, 0), (4, 32)])
def test_strawq_case_claims_whole_chunks(tmp_path: Path, chunk: int, chunked: int) -> None:
    res = _queue_ops().run_strawq(str(tmp_path), 2, 32, 2, 16, release_chunk=chunk)
    assert res["groups_s"] > 0
    assert res["chunked"] == chunked, res
