"""What the queue's steps cost in filesystem operations (docs/protocol.md §5, "Metadata
operations per group"): on a shared mount every name operation is a round trip to the
metadata service, so these tests count them on a local directory and pin the ones removed."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from strawq.storage import PosixStorage

from tests.strawq.queue_helpers import make_feeder, make_queue


class CountingStorage(PosixStorage):
    """A ``PosixStorage`` that counts the renames it makes and the files it creates."""

    def __init__(self, root: str, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.ops: Counter[str] = Counter()
        self._tmp_root = os.path.join(self.root, "tmp") + os.sep

    def _rename_noreplace(self, src: str, dst: str) -> None:
        self.ops["rename"] += 1
        super()._rename_noreplace(src, dst)

    def list(self, directory: str) -> list[str]:
        self.ops[f"list {directory}"] += 1
        return super().list(directory)

    def _fill(self, fd: int, path: str, chunks: Any, sync: bool) -> None:
        self.ops["create tmp" if path.startswith(self._tmp_root) else "create in place"] += 1
        super()._fill(fd, path, chunks, sync)


def test_a_release_writes_its_task_records_in_place(tmp_path: Path) -> None:
    """A release's task records are written straight into its private staging directory:
    one create each, no temporary file and no rename per record (on JuiceFS that saved
    2 GetAttr, a Lookup and a Rename per group). The release's own renames remain: the
    cursor commit and the promotion of the staging directory to ``pending/``."""
    st = CountingStorage(str(tmp_path / "run"))
    q = make_queue(st, release_batch=32)
    feeder = make_feeder(q, tmp_path, 32)
    st.ops.clear()
    assert feeder.release() == 32
    assert st.ops["rename"] == 2, st.ops
    assert st.ops["create tmp"] == 0, st.ops
    assert st.ops["create in place"] == 33, st.ops  # 32 task records + the cursor record
    assert len(q.list_pending()) == 32
    assert st.list("staging") == [] and st.list("tmp") == []
