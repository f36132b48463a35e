"""A run's cursor record, hostile behind a valid checksum: the feeder repairs it (the
record quarantined) or refuses with a project error; it never crashes on it."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder, preview_release
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage.memory import MemoryStorage
from strawq.tasks.queue import RunQueue
from tests.fuzz.helpers import clean, frame_meta
from tests.fuzz.test_records_fuzz import values

_DIR = tempfile.mkdtemp(prefix="strawq-fuzz-")
_PATH = os.path.join(_DIR, "rows.jsonl")
with open(_PATH, "w", encoding="utf-8") as _f:
    _f.writelines(json.dumps({"prompt": [1, 2, i]}) + "\n" for i in range(8))
DATASET = Dataset(_PATH)

cursor_keys = st.sampled_from(["seq", "next_index", "staging", "exhausted", "fingerprint",
                               "recent"])
cursor_metas = st.dictionaries(cursor_keys, values | st.integers(0, 10), max_size=6).map(
    lambda m: {"v": records.SCHEMA_VERSION, **m})
fingerprints = st.dictionaries(st.sampled_from(["url", "format", "digest", "size", "base",
                                                "shards"]), values, max_size=6)


@given(cursor_metas, st.none() | fingerprints)
@example({"v": records.SCHEMA_VERSION, "seq": 1, "next_index": 2}, None)
@example({"v": records.SCHEMA_VERSION, "next_index": 2}, None)  # no seq: KeyError escaped
@example({"v": records.SCHEMA_VERSION, "seq": 1, "next_index": 2, "fingerprint": [1]}, None)
@example({"v": records.SCHEMA_VERSION, "seq": 1, "next_index": 2},
         {"format": "jsonl", "digest": "x", "base": "zz"})
@pytest.mark.slow
def test_cursor_records_behind_a_valid_checksum(meta: dict[str, Any],
                                                fingerprint: dict[str, Any] | None) -> None:
    if fingerprint is not None:
        fingerprint = {**DATASET.fingerprint, **fingerprint}
        meta = {**meta, "fingerprint": fingerprint}
    q = RunQueue.create(MemoryStorage(), QueueConfig(fsync=False))
    q.storage.publish("cursor/000000000001.000000000002", frame_meta(int(Kind.CURSOR), meta))
    clean(preview_release, q, DATASET, 4)
    feeder = clean(Feeder, q, DATASET)
    if isinstance(feeder, Feeder):
        clean(feeder.release, 2)
