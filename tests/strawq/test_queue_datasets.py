"""Datasets through the feeder: bad rows dropped with a reason, the end of a dataset,
Parquet, the cursor."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.errors import DatasetError
from strawq.ondisk import records
from strawq.ondisk.names import note_key
from strawq.storage import MemoryStorage, Storage
from strawq.testing import audit_run, write_jsonl
from strawq.testing.factories import prompts
from strawq.views.status import run_status
from tests.strawq.queue_helpers import make_feeder, make_queue, tid

BAD_ROWS: list[Any] = [
    {"prompt": "good 0"},
    "this is not json",
    {"question": "no prompt key"},
    {"prompt": ""},
    {"prompt": [1, -2, 3]},
    [1, 2, 3],
    {"prompt": [5, 6, 7]},
    {"prompt": True},
]


def test_bad_dataset_rows_are_dropped_with_reason(storage: Storage, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    q = make_queue(storage, max_bad_row_share=1.0)  # drop them all, knowingly
    f = make_feeder(q, tmp_path, BAD_ROWS)
    with caplog.at_level(logging.ERROR):
        assert f.release(10) == len(BAD_ROWS)
    assert f.exhausted
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(len(BAD_ROWS))]) == []
    assert audit.ids("pending") == {tid(0), tid(6)}
    bad = {1, 2, 3, 4, 5, 7}
    assert audit.ids("dropped") == {tid(i) for i in bad}
    assert {audit.name_of(tid(i)).producer for i in bad} == {"bad_row"}
    messages = {i: records.decode(storage.read(note_key(tid(i), 0, "drop", "bad_row")))
                .meta["message"] for i in bad}
    assert "invalid JSON" in messages[1]
    assert "missing 'prompt'" in messages[2] and "question" in messages[2]
    assert "empty string" in messages[3]
    assert "non-negative token ids" in messages[4]
    assert "expected a JSON object" in messages[5]
    assert all(f"data.jsonl line {i + 1}:" in messages[i] for i in bad)
    assert sum("dropping dataset row" in r.message for r in caplog.records) == len(bad)
    assert run_status(q).dropped_by_reason == {"bad_row": len(bad)}


def test_release_at_end_of_dataset_and_all_bad_batches(storage: Storage,
                                                       tmp_path: Path) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, [{"prompt": "a"}, "{bad", "{bad", {"prompt": "d"}])
    assert f.release(1) == 1
    assert f.release(2) == 2  # only bad rows: nothing staged, cursor still advances
    assert f.cursor.next_index == 3 and storage.list("staging") == []
    assert f.release(5) == 1 and f.exhausted
    assert f.release(5) == 0
    f2 = Feeder(q, f.dataset)
    assert f2.cursor.next_index == 4 and f2.exhausted and f2.release(3) == 0
    assert audit_run(storage).check([tid(i) for i in range(4)]) == []


def test_parquet_dataset_across_row_groups(storage: Storage, tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    table = pa.table({"prompt": [f"p{i}" if i != 5 else "" for i in range(11)],
                      "label": list(range(11))})
    pq.write_table(table, path, row_group_size=4)
    q = make_queue(storage)
    f = Feeder(q, Dataset(str(path)))
    assert f.dataset.fmt == "parquet" and len(f.dataset) == 11
    assert f.release(3) == 3 and f.release(6) == 6 and f.release(6) == 2
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(11)]) == []
    assert audit.ids("dropped") == {tid(5)}
    (lease,) = [lease for lease in q.claim("p", 11) if lease.task_id == tid(9)]
    assert lease.task["row"] == {"prompt": "p9", "label": 9}


def test_dataset_errors_are_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        Dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match="unknown dataset format"):
        Dataset(write_jsonl(tmp_path / "d.jsonl", prompts(1)), fmt="csv")
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="Parquet"):
        Dataset(str(tmp_path / "fake.parquet")).read(0, 1)


def test_feeder_checkpoint_state_restores_on_a_fresh_queue(storage: Storage,
                                                           tmp_path: Path) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 10)
    f.release(4)
    state = f.state_dict()
    assert state["next_index"] == 4
    other = MemoryStorage()
    q2 = make_queue(other)
    f2 = make_feeder(q2, tmp_path, 10)
    f2.load_state_dict(state)
    assert f2.release(3) == 3
    assert audit_run(other).ids("pending") == {tid(4), tid(5), tid(6)}
    with pytest.raises(FileExistsError):
        f.load_state_dict(state)
