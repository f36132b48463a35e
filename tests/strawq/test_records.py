"""The fast column decoder agrees with the general one, and refuses what the general one does."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strawq.errors import CorruptRecord, NewerFormat
from strawq.ondisk import records
from strawq.ondisk.groups import TOKEN_COLUMNS, GroupData, decode_group, decode_group_columns
from strawq.ondisk.records import Kind


@st.composite
def groups(draw: st.DrawFn) -> GroupData:
    g = draw(st.integers(0, 6))
    lens = draw(st.lists(st.integers(0, 40), min_size=g, max_size=g))
    n = sum(lens)
    plen = draw(st.integers(0, 20))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    return GroupData(task_id=f"t{seed % 1000}", index=draw(st.integers(0, 10**9)),
                     prompt_ids=rng.integers(-2**31, 2**31 - 1, plen, dtype=np.int32),
                     sample_lens=lens,
                     tokens=rng.integers(-2**31, 2**31 - 1, n, dtype=np.int32),
                     logprobs=rng.standard_normal(n).astype(np.float32),
                     versions=rng.integers(-5, 2**40, n, dtype=np.int64),
                     loss_mask=rng.integers(0, 256, n, dtype=np.uint8),
                     rewards=[draw(st.none() | st.floats(-1, 1)) for _ in range(g)],
                     status=[draw(st.sampled_from(["completed", "truncated", "aborted"]))
                             for _ in range(g)],
                     meta={"k": draw(st.integers(-2**63, 2**63 - 1))})


def _aligned(data: bytes) -> memoryview:
    """The record in a 64-byte aligned, writable buffer (as the reader holds it)."""
    raw = np.empty(len(data) + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    buf = raw[skip:skip + len(data)]
    buf[:] = np.frombuffer(data, dtype=np.uint8)
    return memoryview(buf)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups(), st.sampled_from([Kind.GROUP, Kind.PARTIAL]))
def test_fast_columns_equal_the_general_decoder(grp, kind):
    data = b"".join(grp.encode(kind))
    ref = decode_group(data)
    for view in (data, _aligned(data)):
        got = decode_group_columns(view, name="g")
        assert got.summary == ref.summary()
        assert got.prompt.dtype == np.int32
        assert np.array_equal(got.prompt, ref.prompt_ids)
        for c, dt in TOKEN_COLUMNS.items():
            assert got.columns[c].dtype == dt
            assert np.array_equal(got.columns[c], getattr(ref, c))
        rec = records.decode(view)
        fast = records.decode_tables_fast(rec.meta["tables"], rec.payload)
        assert fast is not None  # what encode writes is always the fast path's
        slow = rec.tables()
        assert set(fast) == set(slow)
        for t, cols in fast.items():
            assert list(cols) == slow[t].schema.names
            for c, arr in cols.items():
                assert np.array_equal(arr, slow[t].column(c).to_numpy())


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups(), st.data())
def test_corrupted_bytes_raise_corrupt_record_as_the_general_decoder_does(grp, data):
    raw = bytearray(b"".join(grp.encode()))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend"]))
    if how == "flip":
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    else:
        raw += b"\0" * data.draw(st.integers(1, 64))
    try:
        ref = decode_group(bytes(raw))
    except CorruptRecord:
        ref = None
    if ref is None:
        with pytest.raises(CorruptRecord):
            decode_group_columns(bytes(raw), name="g")
        return
    # a flip in bytes outside the checksum (reserved header fields, alignment padding)
    got = decode_group_columns(bytes(raw), name="g")
    assert np.array_equal(got.prompt, ref.prompt_ids)
    assert all(np.array_equal(got.columns[c], getattr(ref, c)) for c in TOKEN_COLUMNS)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups(), st.data())
def test_unverified_garbage_never_crashes_the_fast_parser(grp, data):
    """Without the checksum (verify=False) damaged Arrow bytes still end in CorruptRecord or
    in the general decoder's answer; the fast parser itself never raises."""
    raw = bytearray(b"".join(grp.encode()))
    rec = records.decode(bytes(raw))
    start = len(raw) - len(rec.payload)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(start, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))
    rec = records.decode(bytes(raw), verify=False)
    try:
        records.decode_tables_fast(rec.meta["tables"], rec.payload)
    except Exception as exc:  # pragma: no cover - the assertion below reports it
        pytest.fail(f"decode_tables_fast raised {exc!r}")
    try:
        got = decode_group_columns(bytes(raw), name="g", verify=False)
    except CorruptRecord:
        return
    n = sum(got.summary["sample_lens"])
    assert all(got.columns[c].shape == (n,) for c in TOKEN_COLUMNS)


def _record_with(tables: dict[str, pa.RecordBatch], summary: dict) -> bytes:
    """A GROUP record whose Arrow streams are written by pyarrow directly."""
    index: dict[str, list[int]] = {}
    chunks: list[bytes] = []
    off = 0
    for name, batch in tables.items():
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        buf = sink.getvalue().to_pybytes()
        pad = (-len(buf)) % 64
        index[name] = [off, len(buf)]
        chunks += [buf, b"\0" * pad]
        off += len(buf) + pad
    import msgpack
    import xxhash

    meta = msgpack.packb({"v": 1, "group": summary, "tables": index}, use_bin_type=True)
    payload = b"".join(chunks)
    head = records.HEADER.pack(records.MAGIC, records.FORMAT_VERSION, int(Kind.GROUP), 0,
                               len(meta), 0, len(payload),
                               xxhash.xxh3_64_intdigest(meta + payload)) + meta
    return head + b"\0" * ((-len(head)) % 64) + payload


def _summary(lens: list[int], plen: int) -> dict:
    return {"task_id": "x", "index": 0, "sample_lens": lens, "prompt_len": plen,
            "rewards": [0.0] * len(lens), "status": ["completed"] * len(lens),
            "min_version": 0, "max_version": 0, "num_versions": 1, "meta": {}}


def _token_batch(n: int, **override: pa.Array) -> pa.RecordBatch:
    cols = {"tokens": pa.array(np.arange(n, dtype=np.int32)),
            "logprobs": pa.array(np.zeros(n, dtype=np.float32)),
            "versions": pa.array(np.ones(n, dtype=np.int64)),
            "loss_mask": pa.array(np.ones(n, dtype=np.uint8))}
    cols.update(override)
    return pa.RecordBatch.from_pydict(cols)


def test_streams_the_fast_path_skips_go_the_general_way():
    prompt = pa.RecordBatch.from_pydict({"ids": pa.array(np.arange(3, dtype=np.int32))})
    # extra column and another order: the general path reads it all the same
    odd = pa.RecordBatch.from_pydict({
        "loss_mask": pa.array(np.ones(4, dtype=np.uint8)),
        "note": pa.array(["a", "b", "c", "d"]),
        "tokens": pa.array(np.arange(4, dtype=np.int32)),
        "versions": pa.array(np.ones(4, dtype=np.int64)),
        "logprobs": pa.array(np.zeros(4, dtype=np.float32))})
    data = _record_with({"prompt": prompt, "tokens": odd}, _summary([1, 3], 3))
    rec = records.decode(data)
    assert records.decode_tables_fast(rec.meta["tables"], rec.payload) is None
    got = decode_group_columns(data)
    assert got.columns["tokens"].tolist() == [0, 1, 2, 3]
    # nulls: no zero-copy view; the general path reports a corrupt group
    nulls = _token_batch(4, logprobs=pa.array([0.0, None, 1.0, 2.0], type=pa.float32()))
    data = _record_with({"prompt": prompt, "tokens": nulls}, _summary([4], 3))
    with pytest.raises(CorruptRecord):
        decode_group_columns(data)
    # a wrong dtype (int64 tokens) is refused with the column named
    wide = _token_batch(4, tokens=pa.array(np.arange(4, dtype=np.int64)))
    data = _record_with({"prompt": prompt, "tokens": wide}, _summary([4], 3))
    with pytest.raises(CorruptRecord, match="'tokens'"):
        decode_group_columns(data)
    # columns shorter than sum(sample_lens): docs/design.md, invariant 4
    data = _record_with({"prompt": prompt, "tokens": _token_batch(4)}, _summary([4, 1], 3))
    with pytest.raises(CorruptRecord, match="sum of sample_lens"):
        decode_group_columns(data)


def test_two_batches_in_one_stream_are_refused():
    prompt = pa.RecordBatch.from_pydict({"ids": pa.array(np.arange(3, dtype=np.int32))})
    tok = _token_batch(2)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, tok.schema) as w:
        w.write_batch(tok)
        w.write_batch(tok)
    stream = sink.getvalue().to_pybytes()
    assert records.decode_ipc_columns(memoryview(stream)) is None
    good = _record_with({"prompt": prompt, "tokens": tok}, _summary([2], 3))
    assert decode_group_columns(good).columns["tokens"].tolist() == [0, 1]


def test_a_damaged_version_byte_is_corrupt_and_a_newer_framing_is_newer() -> None:
    """The framing version is outside the checksum. A record whose version byte reads newer
    but whose layout and checksum are this framing's is damaged (quarantined as corrupt);
    one whose checksum does not verify as this framing's is a newer strawq's (the part
    stops, nothing dropped)."""
    raw = bytearray(b"".join(records.encode(Kind.TASK, {"id": "t0"})))
    raw[4] = records.FORMAT_VERSION + 2  # the version byte, after the 4-byte magic
    with pytest.raises(CorruptRecord, match="damaged header"):
        records.decode(bytes(raw))
    raw[-1] ^= 0xFF  # and the rest no longer verifies as this framing: a newer one's
    with pytest.raises(NewerFormat, match="framing version 3"):
        records.decode(bytes(raw))


@pytest.mark.process
def test_a_record_with_a_table_is_encoded_without_importing_pandas() -> None:
    # pa.array's first call imports pandas (~0.3-0.8 s): a verl queue's first put paid it
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from strawq.ondisk import records\n"
            "records.encode(records.Kind.STATE, {}, {'s': {'b': np.zeros(9, np.uint8)}})\n"
            "print('pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", ["u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4",
                                   "f8", "?"])
def test_table_bytes_are_the_ones_pa_array_writes(dtype: str) -> None:
    for column in (np.arange(37).astype(dtype), np.arange(37).astype(dtype)[::3],
                   np.zeros(0, dtype)):
        _, chunks = records.encode_tables({"t": {"c": column}})
        batch = pa.RecordBatch.from_pydict({"c": pa.array(np.ascontiguousarray(column))})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        assert chunks[0] == sink.getvalue().to_pybytes()
