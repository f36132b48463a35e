"""Task names, dataset rows (JSONL and Parquet), engine replies and config files: hostile
input gives a project error (or a bad row with its reason), never another exception."""

from __future__ import annotations

import io
import json
import os
import tempfile
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strawq.config import QueueConfig, from_dict, load_config
from strawq.data.dataset import BadRow, Dataset
from strawq.ondisk.names import TaskName, parse_heartbeat
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sglang_protocol import parse_generate_body
from tests.fuzz.helpers import clean

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=4),
    max_leaves=25)

VALID_NAME = "000000000003.000000000007~t-1~g0~a1~r0~p-x"
name_text = st.text(alphabet="0123456789.~agrpt-x²٣\n/ ", max_size=40) | st.text(max_size=40)


@given(name_text)
@example(VALID_NAME)
@example("000000000003.000000000007~t~g٣~a1~r0")  # non-ASCII digits: no task name
@example("p-1~²")  # "²".isdigit() yet int("²") raised ValueError
def test_task_names(text: str) -> None:
    name = clean(TaskName.parse, text)
    if isinstance(name, TaskName):
        assert str(name) == text and text.isascii()
    clean(TaskName.try_parse, text)
    clean(parse_heartbeat, text)


meta_info = st.fixed_dictionaries({}, optional={
    "finish_reason": json_values | st.fixed_dictionaries({"type": st.sampled_from(
        ["stop", "length", "abort", "x"])}, optional={"matched": json_values}),
    "weight_version": json_values, "output_token_logprobs": json_values,
    "id": json_values, "prompt_tokens": json_values, "completion_tokens": json_values,
    "weight_version_spans": json_values, "cached_tokens": json_values})
replies = st.fixed_dictionaries({}, optional={
    "output_ids": json_values | st.lists(st.integers(-2**40, 2**40), max_size=5),
    "meta_info": meta_info | json_values, "text": json_values, "error": json_values})


@given(replies | json_values | st.lists(replies, max_size=3))
@example({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"},
                                              "weight_version": "1",
                                              "output_token_logprobs": [[0.0, 1], [0.0, 2]]}})
def test_engine_replies(body: Any) -> None:
    for default in (None, 0):
        clean(parse_generate_body, body, url="http://e", default_version=default)


def _dataset(data: bytes, suffix: str) -> list[Any] | Exception:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        ds = clean(Dataset, path)
        if isinstance(ds, Exception):
            return ds
        n = clean(len, ds)
        if isinstance(n, Exception):
            return n
        got = clean(ds.read, 0, 50)
        if not isinstance(got, Exception):
            assert len(got) <= 50
            for _, row in got:
                if isinstance(row, BadRow):
                    assert row.to_dict()
        return got if isinstance(got, Exception) else list(got)


jsonl_lines = st.lists(
    json_values.map(json.dumps) | st.text(max_size=30) | st.just('{"prompt": [1, 2]}'),
    max_size=6).map(lambda ls: "\n".join(ls).encode())


@given(jsonl_lines | st.binary(max_size=200))
@example(b'{"prompt": [1, 2]}\n\xff\xfe\n')
@example(b'{"prompt": "a"}\n' * 3 + b'{"prompt"')
def test_jsonl_rows(data: bytes) -> None:
    _dataset(data, ".jsonl")


def _parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in rows]}), buf)
    return buf.getvalue()


PARQUET = _parquet_bytes([{"prompt": [1, 2, 3]}, {"prompt": [4]}])


@given(st.lists(st.tuples(st.integers(0, len(PARQUET) - 1), st.integers(0, 255)), max_size=6),
       st.none() | st.integers(0, len(PARQUET)))
@pytest.mark.slow
@example([(189, 1)], None)  # a damaged footer's negative row count: ValueError from len()
@example([(94, 0)], None)  # pyarrow's OSError (corrupt snappy data) escaped the reader
@example([], 12)
@example([], None)
def test_parquet_files(edits: list[tuple[int, int]], cut: int | None) -> None:
    out = bytearray(PARQUET)
    for pos, byte in edits:
        out[pos] = byte
    _dataset(bytes(out[:cut] if cut is not None else out), ".parquet")


@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
@example(b'{"batch_groups": 1e400}')
@example(b'{"producer": {"engine": {"client": {"api_key": 5}}}}')
@example(b"[" * 100_000)  # RecursionError escaped
def test_config_files(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.json")
        with open(path, "wb") as f:
            f.write(data)
        clean(load_config, QueueConfig, path)
        clean(load_config, ProducerConfig, path)


@given(st.dictionaries(st.sampled_from(["engine", "budget", "sampling", "timing", "plugins",
                                        "record", "run_dir", "x"]), json_values, max_size=4))
def test_config_mappings(data: dict[str, Any]) -> None:
    clean(from_dict, ProducerConfig, data)
    clean(from_dict, QueueConfig, data)
