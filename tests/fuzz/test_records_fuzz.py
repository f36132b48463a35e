"""Records, group payloads, manifests, cursors and the drop audit: hostile bytes (even with
a valid checksum, which anyone with write access to the run can compute) give a
``CorruptRecord`` or a result, never another exception, a hang or a huge allocation."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strawq.config import QueueConfig
from strawq.data.cursor import read_cursor_state
from strawq.delivery import commits, retention
from strawq.errors import NewerFormat
from strawq.delivery.batches import (
    ACK_DIR,
    DELIVERED_DIR,
    HIGH_WATER_DIR,
    MANIFEST_DIR,
    BatchStore,
    batch_seqs,
    decode_manifest,
    delivered,
    high_water,
)
from strawq.ondisk import records
from strawq.ondisk.groups import decode_group, decode_group_columns
from strawq.ondisk.names import TaskName, data_key
from strawq.ondisk.records import Kind
from strawq.storage.memory import MemoryStorage
from strawq.storage.posix import PosixStorage
from strawq.tasks import epochs, eta
from strawq.tasks.queue import RunQueue
from strawq.testing.factories import make_group
from strawq.weights import control
from tests.fuzz.helpers import clean, frame, frame_meta, header_with

# msgpack-able values a hostile writer may put in a record's metadata
leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
          | st.text(max_size=20) | st.binary(max_size=20))
map_keys = st.text(max_size=8) | st.integers(-2**63, 2**63)
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(map_keys, inner, max_size=4), max_leaves=20)
# metadata maps built from the names the decoders look up
keys = st.sampled_from(["v", "tables", "group", "seq", "groups", "summaries", "meta",
                        "fingerprint", "exhausted", "recent", "counts", "compacted", "drops",
                        "task_id", "index", "sample_lens", "rewards", "status", "extras"])
metas = st.dictionaries(keys, values, max_size=8).map(lambda m: {"v": records.SCHEMA_VERSION,
                                                                 **m})

GROUP = b"".join(make_group("t1", 0, lens=(3, 2)).encode())
_G = records.decode(GROUP)


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, byte in edits:
        out[pos % len(out)] = byte
    return bytes(out[:cut] if cut is not None else out)


mutations = st.tuples(st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)),
                               max_size=6), st.none() | st.integers(0, len(GROUP)))


@given(st.binary(max_size=512), st.booleans())
@example(b"", True)
@example(records.MAGIC + b"\x01" * 28, False)
@example(records.HEADER.pack(records.MAGIC, records.FORMAT_VERSION, 200, 0, 99, 0, 0, 0),
         False)  # an unknown kind: ValueError from decode_meta_only
@example(frame(2, b"\x05"), True)  # metadata not a map
def test_arbitrary_bytes_as_a_record(data: bytes, verify: bool) -> None:
    clean(records.decode, data, verify=verify)
    clean(records.decode_meta_only, data)


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
@example(2**32 - 1, 2**40)
@example(0, 2**64 - 1)
def test_huge_length_fields_are_refused_without_allocating(meta_len: int, payload_len: int
                                                          ) -> None:
    data = header_with(GROUP, meta_len=meta_len, payload_len=payload_len)
    clean(records.decode, data, verify=False)
    kind_meta = clean(records.decode_meta_only, data[:64])
    if isinstance(kind_meta, tuple):  # says how much more to read: bounded
        assert kind_meta[2] <= len(data) or meta_len + records.HEADER.size == kind_meta[2]


@given(st.integers(0, 255), st.binary(max_size=256), st.binary(max_size=256))
@example(2, b"\xdd\xff\xff\xff\xff", b"")  # msgpack: an array of 2^32-1 items, 0 present
@example(2, b"\xc6\xff\xff\xff\xff", b"")  # msgpack: a 4 GiB bin, 0 bytes present
def test_framed_arbitrary_metadata_and_payload(kind: int, meta: bytes, payload: bytes) -> None:
    data = frame(kind, meta, payload)
    rec = clean(records.decode, data)
    if isinstance(rec, records.Record):
        clean(rec.tables)
    clean(decode_group_columns, data)


@given(mutations)
@example(([(31821, 1)], None))  # a flatbuffers error from pyarrow (OSError) escaped
@example(([(1144, 1)], None))  # ArrowInvalid (a null in a column viewed zero-copy) escaped
def test_mutated_group_records(m: tuple[list[tuple[int, int]], int | None]) -> None:
    data = _mutate(GROUP, *m)
    for verify in (True, False):
        clean(decode_group_columns, data, verify=verify)
    clean(decode_group, data)
    # the same damage behind a valid checksum
    view = clean(records.decode, data, verify=False)
    if isinstance(view, records.Record):
        refr = frame(int(view.kind), msgpack.packb(view.meta), bytes(view.payload))
        clean(decode_group, refr)
        clean(decode_group_columns, refr)


@given(metas, st.sampled_from([Kind.GROUP, Kind.PARTIAL]))
@example({"v": records.SCHEMA_VERSION, "tables": [1, 2]}, Kind.GROUP)
@example({"v": records.SCHEMA_VERSION, "tables": {"tokens": [0, 2**40]}}, Kind.GROUP)
@example({"v": records.SCHEMA_VERSION, "tables": {"tokens": "ab"}}, Kind.GROUP)
@example({"v": records.SCHEMA_VERSION, "group": [], "tables": {}}, Kind.GROUP)
def test_group_records_with_hostile_metadata(meta: dict[str, Any], kind: Kind) -> None:
    merged = {**_G.meta, **meta}
    for m in (meta, merged):
        data = frame_meta(int(kind), m, bytes(_G.payload))
        clean(decode_group, data)
        clean(decode_group_columns, data)


@given(metas)
@example({"v": records.SCHEMA_VERSION, "seq": 1, "groups": ["nope"], "summaries": [],
          "meta": {}})
@pytest.mark.slow
@example({"v": records.SCHEMA_VERSION, "seq": "1", "groups": 5, "summaries": [], "meta": {}})
def test_manifests(meta: dict[str, Any]) -> None:
    clean(decode_manifest, frame_meta(int(Kind.MANIFEST), meta), name="batches/x")


@pytest.mark.slow
@given(metas, st.binary(max_size=64))
@example({"v": records.SCHEMA_VERSION, "recent": "xy"}, b"")
@example({"v": records.SCHEMA_VERSION, "recent": [1]}, b"")
@example({"v": records.reads(Kind.CURSOR) + 1}, b"")  # a newer strawq's cursor
def test_cursor_records(meta: dict[str, Any], junk: bytes) -> None:
    for data in (frame_meta(int(Kind.CURSOR), meta), junk):
        s = MemoryStorage()
        s.publish("cursor/000000000001.000000000005", data)
        state = clean(read_cursor_state, s)
        if isinstance(state, NewerFormat):  # refused loudly, never skipped as corrupt
            assert data is not junk and meta["v"] > records.reads(Kind.CURSOR)
            continue
        assert not isinstance(state, Exception) and state is not None
        assert state["next_index"] == 5


@given(st.lists(st.text(alphabet="0123456789.²٣x", max_size=30), max_size=4))
@example(["².1"])  # "²".isdigit() yet int("²") raised ValueError
@example(["٣٣.1"])
def test_cursor_names(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:  # names a writer may leave on the mount
        os.mkdir(os.path.join(d, "cursor"))
        for n in names:
            if n and n not in (".", ".."):
                open(os.path.join(d, "cursor", n), "wb").close()
        clean(read_cursor_state, PosixStorage(d, read_only=True))


@pytest.mark.slow
@given(metas, st.binary(max_size=64))
@example({"v": records.SCHEMA_VERSION, "counts": 5}, b"")  # TypeError escaped
@example({"v": records.SCHEMA_VERSION, "counts": [1, 2]}, b"")
@example({"v": records.SCHEMA_VERSION, "drops": 3}, b"")
@example({"v": records.reads(Kind.STATE) + 1}, b"")  # a newer strawq's segment
def test_drop_audit_segments(meta: dict[str, Any], junk: bytes) -> None:
    for data in (frame_meta(int(Kind.STATE), meta), junk):
        s = MemoryStorage()
        s.publish(retention._key(1), data)
        audit = clean(retention.latest_audit, s)
        if isinstance(audit, NewerFormat):  # refused loudly, never skipped as corrupt
            assert data is not junk and meta["v"] > records.reads(Kind.STATE)
            continue
        assert not isinstance(audit, Exception)
        clean(retention._read, s, 1)


_QUEUE = RunQueue.create(MemoryStorage(), QueueConfig(fsync=False))
_NAME = TaskName.parse("000000000003.000000000007~t1~g0~a1~r0")


@given(st.one_of(mutations.map(lambda m: _mutate(GROUP, *m)),
                 st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)).map(
                     lambda lens: header_with(GROUP, meta_len=lens[0], payload_len=lens[1])),
                 metas.map(lambda m: frame_meta(int(Kind.GROUP), m))))
@pytest.mark.slow
@example(header_with(GROUP, meta_len=2**32 - 1))  # read_prefix of 4 GiB was asked for
@example(frame_meta(int(Kind.GROUP), {"v": records.SCHEMA_VERSION, "group": 5}))
def test_group_summaries_from_record_headers(data: bytes) -> None:
    key = data_key(_NAME.id, _NAME.gen, "group")
    _QUEUE.storage.delete(key)
    _QUEUE.storage.publish(key, data)
    clean(BatchStore(_QUEUE).read_summary, _NAME)


@given(st.lists(st.text(alphabet="0123456789.-bseq²٣x", min_size=1, max_size=16), max_size=5))
@example(["²"])  # "²".isdigit() yet int("²") raised ValueError
@example(["bseq-²", "1.²"])
def test_batch_directory_names(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:  # names a writer may leave on the mount
        for sub in (MANIFEST_DIR, ACK_DIR, DELIVERED_DIR, HIGH_WATER_DIR):
            os.mkdir(os.path.join(d, sub))
            for n in names:
                if n not in (".", ".."):
                    open(os.path.join(d, sub, n), "wb").close()
        s = PosixStorage(d, read_only=True)
        clean(batch_seqs, s)
        clean(high_water, s)
        clean(delivered, s)


_LISTING_NAMES = st.lists(st.sampled_from(["epoch-", "hb-", "start-", "policy-", "pause-",
                                           "resume-", "ack-", "closed-", ""]).flatmap(
    lambda head: st.text(alphabet="0123456789~²٣x-", max_size=14).map(lambda t: head + t)),
    max_size=6)


@given(_LISTING_NAMES)
@example(["epoch-²", "hb-000000000001~²", "start-²~1", "closed-²"])
@example(["pause-²", "resume-²", "ack-²~p", "policy-²", "²"])
def test_names_listed_from_run_directories(names: list[str]) -> None:
    """Numbers read from file names (``"²".isdigit()`` is true, yet ``int("²")`` fails)."""
    clean(epochs.epochs, names)
    clean(epochs.heartbeat_counter, names, 1)
    clean(epochs.prunable, names, 5)
    clean(epochs.epoch_starts, MemoryStorage(), names)
    with tempfile.TemporaryDirectory() as d:  # names a writer may leave on the mount
        for sub in ("control", "committed", "versions", eta.POLICY_DIR):
            os.mkdir(os.path.join(d, sub))
            for n in set(names) - {""}:
                open(os.path.join(d, sub, n), "wb").close()
        st_ = PosixStorage(d, read_only=True)
        clean(control.read_state, st_)
        clean(commits.committed_seq, st_)
        clean(eta._epochs, st_)
