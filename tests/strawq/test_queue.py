"""Unit tests of every queue operation and error path, on MemoryStorage and PosixStorage."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strawq import records
from strawq.batches import BatchStore
from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig, from_dict
from strawq.control import Control
from strawq.dataset import Dataset
from strawq.errors import (
    ConfigError,
    CorruptRecord,
    DatasetError,
    LeaseLost,
    NotFound,
    TaskNotFound,
)
from strawq.feeder import Feeder, list_cursors
from strawq.grantor import LeaseMonitor
from strawq.names import TaskName, data_key, note_key, dataset_task_id
from strawq.queue import Lease, RunQueue
from strawq.records import Kind
from strawq.status import run_status
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.testing import audit_run, make_group, write_jsonl
from strawq.testing.factories import make_partial, prompts


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "memory":
        return MemoryStorage()
    return PosixStorage(str(tmp_path / "run"))


def make_queue(storage: Storage, **cfg: Any) -> RunQueue:
    cfg.setdefault("lease_timeout_s", 10.0)
    cfg.setdefault("heartbeat_interval_s", 1.0)
    return RunQueue.create(storage, QueueConfig(**cfg))


def make_feeder(q: RunQueue, tmp_path: Path, rows: list[Any] | int,
                name: str = "data.jsonl") -> Feeder:
    data = prompts(rows) if isinstance(rows, int) else rows
    return Feeder(q, Dataset(write_jsonl(tmp_path / name, data),
                             prompt_key=q.config.prompt_key))


def ids(leases: list[Lease]) -> list[str]:
    return [lease.task_id for lease in leases]


def tid(i: int) -> str:
    return dataset_task_id(i)


def clobber(storage: Storage, key: str, data: bytes) -> None:
    """Replace a record's bytes, as a torn write or bit rot would leave them."""
    storage.delete(key)
    storage.publish(key, data)


# -- release and claim order ----------------------------------------------------------------

def test_release_puts_rows_in_pending_in_dataset_order(storage: Storage,
                                                       tmp_path: Path) -> None:
    q = make_queue(storage, release_batch=4)
    f = make_feeder(q, tmp_path, 10)
    assert f.release() == 4
    assert f.release(3) == 3
    keys = q.list_pending()
    assert [TaskName.parse(k.rsplit("/", 1)[1]).id for k in keys] == [tid(i) for i in range(7)]
    assert all(k.startswith("pending/r-") for k in keys)
    assert f.cursor.next_index == 7 and not f.exhausted
    rec = records.decode(storage.read(keys[2]), expect=Kind.TASK)
    assert rec.meta["task"] == {"index": 2, "id": tid(2), "row": prompts(10)[2]}
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(7)]) == []
    assert audit.counts()["pending"] == 7


def test_claim_order_partials_by_version_then_returned_then_fresh(storage: Storage,
                                                                   tmp_path: Path) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 12)
    f.release(4)
    f.release(4)
    first = q.claim("p1", 5)
    assert ids(first) == [tid(i) for i in range(5)]
    by_id = {lease.task_id: lease for lease in first}
    q.yield_partial(by_id[tid(4)], make_partial(tid(4), 4, version=7))
    q.yield_partial(by_id[tid(1)], make_partial(tid(1), 1, version=3))
    q.yield_partial(by_id[tid(3)], make_partial(tid(3), 3, version=3))
    q.release(by_id[tid(2)])
    q.release(by_id[tid(0)])
    f.release(4)
    order = ids(q.claim("p2", 20))
    # partials by min version (ties in dataset order), returned in dataset order, then fresh
    assert order == [tid(1), tid(3), tid(4), tid(0), tid(2),
                     *(tid(i) for i in range(5, 12))]


def test_claim_never_returns_more_than_asked_or_pending(storage: Storage,
                                                        tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 3).release(3)
    assert q.claim("p", 0) == []
    assert len(q.claim("p", 2)) == 2
    assert len(q.claim("p", 5)) == 1
    assert q.claim("p", 5) == []
    with pytest.raises(ConfigError):
        q.claim("bad producer/../x", 1)


def test_attempts_counted_at_claim_refunded_by_yield_and_release(storage: Storage,
                                                                 tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=2)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen, lease.producer) == (1, 0, "p")
    q.release(lease)
    state, name = q.find(tid(0))
    assert (state, name.attempts, name.gen) == ("pending", 0, 1)
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen) == (1, 1)
    q.yield_partial(lease, make_partial(tid(0)))
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen, lease.name.resume) == (1, 2, 1)
    # many refunded cycles never exhaust max_attempts
    for _ in range(5):
        q.release(lease)
        (lease,) = q.claim("p")
    assert lease.name.attempts == 1 and lease.gen == 7


def test_fail_requeues_then_drops_at_max_attempts(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=2)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    dst = q.fail(lease, "engine_error", "HTTP 500 from engine")
    assert dst.startswith("pending/")
    note = records.decode(storage.read(note_key(tid(0), 0, "fail", "engine_error")),
                          expect=Kind.FAIL)
    assert note.meta["reason"] == "engine_error" and "HTTP 500" in note.meta["message"]
    (lease,) = q.claim("p")
    assert (lease.name.attempts, lease.gen) == (2, 1)
    dst = q.fail(lease, "engine_error", "HTTP 500 again")
    assert dst.startswith("dropped/")
    state, name = q.find(tid(0))
    assert (state, name.producer) == ("dropped", "engine_error.max_attempts")
    note = records.decode(storage.read(note_key(tid(0), 1, "drop", "engine_error.max_attempts")),
                          expect=Kind.DROP)
    assert note.meta["reason"] == "engine_error.max_attempts"
    assert note.meta["attempts"] == 2
    assert q.claim("p") == []
    assert audit_run(storage).check([tid(0)]) == []
    assert run_status(q).dropped_by_reason == {"engine_error.max_attempts": 1}


def test_fail_not_retryable_drops_at_once(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=5)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.fail(lease, "prompt_too_long", "4097 > 4096 tokens", retryable=False)
    assert q.find(tid(0))[1].producer == "prompt_too_long"
    with pytest.raises(ConfigError):
        q.fail(lease, "bad reason!", "")


def test_drop_records_reason_and_summary(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    a, b = q.claim("p", 2)
    q.drop(a, "zero_reward_variance", "all rewards 1.0", summary={"rewards": [1.0, 1.0]})
    note = records.decode(storage.read(note_key(a.task_id, a.gen, "drop", "zero_reward_variance")),
                          expect=Kind.DROP)
    assert note.meta["summary"] == {"rewards": [1.0, 1.0]}
    assert q.find(a.task_id)[0] == "dropped"
    assert q.find(b.task_id)[0] == "leased"
    before = audit_run(storage)
    try:  # a retried drop: fenced, or (POSIX, NFS retry rule) a no-op success
        q.drop(a, "zero_reward_variance")
    except LeaseLost:
        pass
    after = audit_run(storage)
    assert after.entries == before.entries and after.check([a.task_id, b.task_id]) == []
    with pytest.raises(LeaseLost):
        q.drop(a, "another_reason")


# -- leases, expiry, fencing ----------------------------------------------------------------

def test_expiry_bumps_generation_and_fences_the_old_holder(storage: Storage,
                                                           tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    old, other = q.claim("slow", 2)
    assert mon.scan().expired == []
    clock.advance(9.9)
    assert mon.scan().expired == []
    clock.advance(0.2)
    res = mon.scan()
    assert sorted(res.expired) == [tid(0), tid(1)] and res.leases == 2
    state, name = q.find(tid(0))
    assert (state, name.gen, name.attempts, name.producer) == ("pending", 1, 1, None)
    ready_before = storage.list("ready")
    with pytest.raises(LeaseLost, match="no longer held"):
        q.complete(old, make_group(tid(0), marker=1.0))
    assert storage.list("ready") == ready_before == []
    assert not storage.exists(data_key(tid(0), 0, "group")), "fenced payload left behind"
    for op in (lambda: q.yield_partial(other, make_partial(tid(1))),
               lambda: q.release(other), lambda: q.drop(other, "x")):
        with pytest.raises(LeaseLost):
            op()
    assert not storage.exists(data_key(tid(1), 0, "partial"))
    assert not q.still_held(old)
    new = q.claim("fast", 2)
    assert sorted((lease.task_id, lease.gen) for lease in new) == [(tid(0), 1), (tid(1), 1)]
    for lease in new:
        q.complete(lease, make_group(lease.task_id, marker=2.0))
    audit = audit_run(storage)
    assert audit.check([tid(0), tid(1)]) == []
    assert audit.ids("ready") == {tid(0), tid(1)}
    assert q.read_group(tid(0), 1).rewards == [2.0, 2.0]


@pytest.mark.parametrize("backend", [
    "memory",
    "posix",
])
def test_fenced_fail_raises_lease_lost(backend: str, tmp_path: Path) -> None:
    storage = MemoryStorage() if backend == "memory" else PosixStorage(str(tmp_path / "run"))
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    (lease,) = q.claim("p")
    mon.scan()
    clock.advance(11)
    assert mon.scan().expired == [tid(0)]
    with pytest.raises(LeaseLost):
        q.fail(lease, "engine_error", "reported after the lease expired")
    assert q.find(tid(0))[1].gen == 1


class _PausedPublish(PosixStorage):
    """Runs ``before_rename`` inside the next publish, between its temp file and rename."""

    before_rename: Any = None

    def _rename_noreplace(self, src: str, dst: str) -> None:
        hook, self.before_rename = self.before_rename, None
        if hook is not None and "/tmp/" in src:
            hook()
        super()._rename_noreplace(src, dst)


def test_holder_expired_mid_publish_gets_lease_lost(tmp_path: Path) -> None:
    storage = _PausedPublish(str(tmp_path / "run"), writer_id="p")
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    (lease,) = q.claim("p")
    mon.scan()

    def grantor_expires_now() -> None:
        clock.advance(11)
        assert mon.scan().expired == [tid(0)]

    storage.before_rename = grantor_expires_now
    with pytest.raises(LeaseLost):
        q.complete(lease, make_group(tid(0)))
    assert q.find(tid(0))[1].gen == 1 and storage.list("ready") == []


def test_heartbeats_keep_leases_alive_on_the_grantors_clock(storage: Storage,
                                                            tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    (alive,) = q.claim("alive")
    (silent,) = q.claim("silent")
    assert q.heartbeat("alive") == 1
    mon.scan()
    expired = []
    for _ in range(5):
        clock.advance(6)
        q.heartbeat("alive")
        res = mon.scan()
        expired += res.expired
    assert expired == [silent.task_id]
    assert res.producers["alive"] == 6 and res.silence["alive"] == 0
    assert q.still_held(alive)
    clock.advance(10)
    assert mon.scan().expired == [alive.task_id]
    assert storage.list("hb") == [f"alive~{6:016d}"], "old heartbeat files must be deleted"


def test_heartbeat_counter_continues_after_restart(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    for _ in range(3):
        q.heartbeat("p")
    q2 = RunQueue.open(storage)
    assert q2.heartbeat("p") == 4
    # a producer that died between publishing a new counter and deleting the old one
    storage.publish(f"hb/p~{9:016d}", b"")
    mon = LeaseMonitor(q2, clock=FakeClock())
    assert mon.scan().producers == {"p": 9}
    assert storage.list("hb") == [f"p~{9:016d}"]


def test_expiry_at_max_attempts_drops_with_a_record(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, max_attempts=2)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    for expected in ("expired", "dropped"):
        q.claim("p")
        mon.scan()
        clock.advance(11)
        res = mon.scan()
        assert getattr(res, expected) == [tid(0)]
    state, name = q.find(tid(0))
    assert (state, name.producer, name.attempts) == ("dropped", "lease_expired.max_attempts", 2)
    assert audit_run(storage).check([tid(0)]) == []


# -- partial yield and resume ---------------------------------------------------------------

def test_yield_resume_round_trip_keeps_per_token_alignment(storage: Storage,
                                                           tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p1")
    assert q.load_partial(lease) is None
    part1 = make_partial(tid(0), 0, lens=(4, 2, 0), version=5)
    q.yield_partial(lease, part1)
    (lease,) = q.claim("p2")
    assert lease.has_partial and lease.name.resume == 0
    loaded = q.load_partial(lease)
    assert loaded is not None
    for col in ("tokens", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(loaded, col), getattr(part1, col))
    part2 = make_partial(tid(0), 0, lens=(1, 3, 2), version=6, prefix=loaded)
    q.yield_partial(lease, part2)
    (lease,) = q.claim("p3")
    assert lease.name.resume == 1 and lease.name.version == 5
    loaded = q.load_partial(lease)
    assert loaded is not None and loaded.sample_lens == [5, 5, 2]
    final = make_group(tid(0), 0, lens=(2, 0, 1), version=7, prefix=loaded, marker=1.0)
    q.complete(lease, final)
    state, name = q.find(tid(0))
    assert state == "ready" and name.version == 5  # staleness = oldest token version
    back = q.read_group(tid(0), name.gen)
    s0 = back.sample(0)
    assert s0["tokens"].tolist() == list(range(1000, 1007))
    assert s0["versions"].tolist() == [5, 5, 5, 5, 6, 7, 7]
    assert all(len(v) == len(s0["tokens"]) for v in s0.values())
    assert back.sample_lens == [7, 5, 3]


def test_complete_refuses_a_group_of_another_task(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    a, _b = q.claim("p", 2)
    with pytest.raises(ConfigError, match="lease is for"):
        q.complete(a, make_group(tid(1)))
    assert q.still_held(a) and storage.list("ready") == []


# -- datasets --------------------------------------------------------------------------------

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
    q = make_queue(storage)
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
    assert all(f"row {i}" in messages[i] for i in bad)
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


# -- configuration ---------------------------------------------------------------------------

def test_config_unknown_keys_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_attempt'\]") as info:
        from_dict(QueueConfig, {"max_attempt": 3})
    assert "max_attempts" in str(info.value)  # the known keys are listed
    with pytest.raises(ConfigError):
        from_dict(QueueConfig, ["not", "a", "mapping"])  # type: ignore[arg-type]
    for bad in ({"max_attempts": 0}, {"lease_timeout_s": 0}, {"heartbeat_interval_s": 99},
                {"release_batch": 0}, {"group_size": 0}, {"prompt_key": ""}):
        with pytest.raises(ConfigError):
            from_dict(QueueConfig, bad)


def test_config_wrong_value_types_refused() -> None:
    for bad in ({"max_attempts": "3"}, {"fsync": "no"}, {"release_batch": 2.5}):
        with pytest.raises(ConfigError):
            from_dict(QueueConfig, bad)


def test_run_with_unknown_config_key_refused_on_open(storage: Storage) -> None:
    body = {"config": {"max_attempts": 3, "shiny_new_knob": 1}, "created_at": 0.0, "meta": {}}
    storage.publish("run.meta", records.encode(Kind.RUN, body))
    with pytest.raises(ConfigError, match="shiny_new_knob"):
        RunQueue.open(storage)


def test_create_is_idempotent_and_refuses_another_config(storage: Storage) -> None:
    q = make_queue(storage, max_attempts=4)
    assert RunQueue.create(storage, q.config).config == q.config
    with pytest.raises(ConfigError, match="refusing to reopen"):
        RunQueue.create(storage, QueueConfig(max_attempts=5))
    assert RunQueue.open(storage).config.max_attempts == 4


def test_open_without_a_run_says_what_to_do(storage: Storage) -> None:
    with pytest.raises(NotFound, match="strawq init"):
        RunQueue.open(storage)


# -- corrupt records: detected, quarantined, reported -----------------------------------------

def _corruptions(good: bytes) -> dict[str, bytes]:
    flipped = bytearray(good)
    flipped[len(flipped) // 2 + 20 if len(flipped) > 80 else 40] ^= 0x40
    return {"empty": b"", "truncated": good[: len(good) // 2], "header_only": good[:32],
            "bitflip": bytes(flipped), "garbage": b"\x00" * 64}


CORRUPTIONS = ["empty", "truncated", "header_only", "bitflip", "garbage"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_task_record_is_quarantined_on_claim(storage: Storage, tmp_path: Path,
                                                     how: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 3).release(3)
    key = q.list_pending()[1]
    good = storage.read(key)
    clobber(storage, key, _corruptions(good)[how])
    with caplog.at_level(logging.ERROR):
        leases = q.claim("p", 3)
    assert ids(leases) == [tid(0), tid(2)]
    assert any("quarantined" in r.message for r in caplog.records)
    (qname,) = storage.list("quarantine")
    assert storage.read(f"quarantine/{qname}") == _corruptions(good)[how], \
        "the bad bytes must be kept for inspection"
    st = run_status(q)
    assert st.quarantined == 1 and st.counts["leased"] == 2
    audit = audit_run(storage)
    assert audit.state_of(tid(1)) == "quarantined"
    assert audit.check([tid(0), tid(1), tid(2)]) == []


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_group_payload_is_quarantined(storage: Storage, tmp_path: Path,
                                              how: str) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.complete(lease, make_group(tid(0), lens=(40, 30)))
    key = data_key(tid(0), 0, "group")
    clobber(storage, key, _corruptions(storage.read(key))[how])
    with pytest.raises(CorruptRecord) as info:
        q.read_group(tid(0), 0)
    assert key in str(info.value)
    assert storage.list("quarantine") == [key.replace("/", "+")]
    assert run_status(q).quarantined == 1


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_partial_is_quarantined_on_resume(storage: Storage, tmp_path: Path,
                                                  how: str) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.yield_partial(lease, make_partial(tid(0), lens=(30, 20)))
    key = data_key(tid(0), 0, "partial")
    clobber(storage, key, _corruptions(storage.read(key))[how])
    (lease,) = q.claim("p")
    with pytest.raises(CorruptRecord):
        q.load_partial(lease)
    assert storage.list("quarantine") == [key.replace("/", "+")]
    assert q.still_held(lease)  # the task itself is not lost: the producer can fail it
    q.fail(lease, "corrupt_partial", "prefix record failed its checksum", retryable=False)
    assert q.find(tid(0))[0] == "dropped"


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_manifest_is_quarantined_by_gc(storage: Storage, tmp_path: Path,
                                               how: str) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    for lease in q.claim("p", 2):
        q.complete(lease, make_group(lease.task_id))
    bs = BatchStore(q)
    bs.publish_batch(1, bs.scan_ready())
    bs.ack(1)
    key = "batches/000000000001"
    clobber(storage, key, _corruptions(storage.read(key))[how])
    rep = bs.gc()
    assert rep.batches == 0
    assert storage.list("quarantine") == [key.replace("/", "+")]
    assert run_status(q).quarantined == 1


def test_corrupt_manifest_does_not_crash_recover(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    for lease in q.claim("p", 2):
        q.complete(lease, make_group(lease.task_id))
    bs = BatchStore(q)
    bs.publish_batch(1, bs.scan_ready())
    clobber(storage, "batches/000000000001", b"")
    BatchStore(q).recover()
    assert storage.list("quarantine") == ["batches+000000000001"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_newest_cursor_is_quarantined_and_reported(storage: Storage, tmp_path: Path,
                                                           how: str) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 10)
    f.release(3)
    f.release(3)
    key = "cursor/" + next(n for s, _, n in list_cursors(storage) if s == 2)
    clobber(storage, key, _corruptions(storage.read(key))[how])
    st = run_status(q)  # must not crash while the bad cursor is still in place
    assert st.counts["pending"] == 6
    assert st.cursor["next_index"] == 6  # the cursor's name still says where it stood
    f2 = Feeder(q, f.dataset)
    assert storage.list("quarantine") == [key.replace("/", "+")]
    # repaired: a new cursor record continues from the damaged one's index, nothing re-released
    assert f2.cursor.seq == 3 and f2.cursor.next_index == 6
    assert run_status(q).quarantined == 1


def test_release_after_corrupt_newest_cursor_loses_nothing(storage: Storage,
                                                          tmp_path: Path) -> None:
    q = make_queue(storage)
    f = make_feeder(q, tmp_path, 10)
    f.release(3)
    f.release(3)
    clobber(storage, "cursor/" + next(n for s, _, n in list_cursors(storage) if s == 2), b"")
    f2 = Feeder(q, f.dataset)
    while f2.release(4):
        pass
    Feeder(q, f.dataset)
    assert audit_run(storage).check([tid(i) for i in range(10)]) == []


def test_corrupt_run_meta_is_an_error_not_a_default(storage: Storage) -> None:
    make_queue(storage)
    clobber(storage, "run.meta", b"SQRC" + b"\x00" * 40)
    with pytest.raises(CorruptRecord):
        RunQueue.open(storage)


def test_foreign_file_in_pending_is_ignored_not_claimed(storage: Storage,
                                                        tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    storage.publish("pending/README", b"not a task")
    assert ids(q.claim("p", 5)) == [tid(0)]
    assert storage.exists("pending/README")


# -- versions, batches, ack, gc ----------------------------------------------------------------

def test_weight_versions_are_monotonic(storage: Storage) -> None:
    q = make_queue(storage)
    assert q.current_version() == 0
    q.set_version(3)
    q.set_version(3)
    q.set_version(5)
    assert q.current_version() == 5 and storage.list("versions") == ["000000000005"]
    with pytest.raises(ConfigError, match="must not go back"):
        q.set_version(4)


def _ready_with_versions(q: RunQueue, tmp_path: Path, versions: list[int]) -> None:
    make_feeder(q, tmp_path, len(versions)).release(len(versions))
    for lease in q.claim("p", len(versions)):
        i = int(lease.task_id[1:])
        q.complete(lease, make_group(lease.task_id, i, version=versions[i]))


def test_ready_scan_is_staleness_first_then_fifo(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [4, 2, 4, 0, 2])
    bs = BatchStore(q)
    names = bs.scan_ready()
    assert [n.id for n in names] == [tid(3), tid(1), tid(4), tid(0), tid(2)]
    summary = bs.read_summary(names[0])
    assert summary["task_id"] == tid(3) and summary["min_version"] == 0
    q.set_version(5)
    assert run_status(q).staleness == {"ready/mean": 5 - 12 / 5, "ready/max": 5.0}


def test_publish_batch_ack_and_gc(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [0, 0, 1, 1, 2])
    bs = BatchStore(q)
    seq = bs.next_seq()
    assert seq == 1
    first = bs.scan_ready()[:3]
    man = bs.publish_batch(seq, first, meta={"step": 1})
    assert [n.id for n in man.groups] == [tid(0), tid(1), tid(2)]
    assert bs.read_manifest(1).meta == {"step": 1}
    assert [n.id for n in bs.scan_ready()] == [tid(3), tid(4)]
    assert run_status(q).counts["batched"] == 3 and run_status(q).batches_unacked == 1
    assert bs.gc().batches == 0  # not acked: nothing to collect
    with pytest.raises(NotFound):
        bs.ack(7)
    bs.ack(1)
    bs.ack(1)
    rep = bs.gc()
    assert (rep.batches, rep.payloads) == (1, 3)
    assert storage.list("batched") == [] and storage.list("batches") == []
    assert not storage.exists(data_key(tid(0), 0, "group"))
    assert storage.exists(data_key(tid(3), 0, "group"))
    assert bs.next_seq() == 2, "a garbage-collected batch seq must never be reused"
    audit = audit_run(storage)
    assert audit.check([tid(i) for i in range(5)], trained={tid(0), tid(1), tid(2)}) == []


def test_batch_recover_finishes_an_interrupted_commit(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [0, 1, 2])
    bs = BatchStore(q)
    names = bs.scan_ready()[:2]
    body = {"seq": 1, "groups": [str(n) for n in names], "summaries": [], "meta": {},
            "at": 0.0}
    storage.publish("batches/000000000001", records.encode(Kind.MANIFEST, body))
    pending = BatchStore(q).recover()
    assert [m.seq for m in pending] == [1]
    assert [n.id for n in bs.scan_ready()] == [tid(2)]
    assert audit_run(storage).check([tid(i) for i in range(3)]) == []


def test_stale_ready_groups_requeued_or_dropped(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    _ready_with_versions(q, tmp_path, [0, 0])
    bs = BatchStore(q)
    a, b = bs.scan_ready()
    assert bs.requeue_ready(a)
    assert bs.drop_ready(b, "too_stale", "staleness 9 > eta 4")
    assert not bs.requeue_ready(b) and not bs.drop_ready(a, "too_stale")
    state, name = q.find(a.id)
    assert (state, name.gen, name.attempts) == ("pending", a.gen + 1, a.attempts - 1)
    assert q.find(b.id)[1].producer == "too_stale"
    assert not storage.exists(data_key(a.id, a.gen, "group"))
    assert audit_run(storage).check([a.id, b.id]) == []


def test_gc_full_removes_only_fenced_generations(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p")
    q.yield_partial(lease, make_partial(tid(0)))          # data/i0~g0.partial (resume)
    (lease,) = q.claim("p")
    q.yield_partial(lease, make_partial(tid(0)))          # data/i0~g1.partial (resume)
    # the superseded prefix goes with the yield that replaced it
    assert not storage.exists(data_key(tid(0), 0, "partial"))
    storage.publish(data_key(tid(0), 0, "group"), make_group(tid(0)).encode())  # orphan
    rep = BatchStore(q).gc(full=True)
    assert rep.stale == 1
    assert storage.list("data") == [f"{tid(0)}~g1.partial"]
    (lease,) = q.claim("p")
    assert q.load_partial(lease) is not None


def test_drained_release_directories_are_collected(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage, release_batch=2)
    f = make_feeder(q, tmp_path, 6)
    while f.release():
        pass
    for lease in q.claim("p", 6):
        q.complete(lease, make_group(lease.task_id))
    bs = BatchStore(q)
    bs.publish_batch(bs.next_seq(), bs.scan_ready())
    bs.ack(1)
    bs.gc(full=True)
    assert storage.list("pending") == []


def test_find_and_task_not_found(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    with pytest.raises(TaskNotFound) as info:
        q.find("i999")
    assert isinstance(info.value, KeyError) and "i999" in str(info.value)
    assert q.find(tid(0))[0] == "pending"


def test_control_bracket(storage: Storage) -> None:
    c = Control(storage)
    assert not c.state().paused
    c.pause(1)
    c.pause(1)
    c.ack(1, "p1", partials=2)
    c.ack(1, "p2")
    st = c.state()
    assert st.paused and st.pause_version == 1 and st.acks == {"p1", "p2"}
    c.resume(1)
    assert not c.state().paused and c.state().resume_version == 1
    with pytest.raises(ConfigError):
        c.ack(2, "../evil")
    for v in range(2, 8):
        c.pause(v)
        c.resume(v)
    assert all(int(n.split("-")[1].split("~")[0]) > 7 - 4 for n in storage.list("control"))


# -- CLI ---------------------------------------------------------------------------------------

def test_cli_init_release_status_inspect_gc(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path / "run")
    data = write_jsonl(tmp_path / "d.jsonl", [*prompts(5), "{broken"])
    assert cli_main(["init", run, "--set", "max_attempts=5", "--set", "release_batch=4"]) == 0
    out = capsys.readouterr().out
    assert "run ready" in out and '"max_attempts": 5' in out
    assert cli_main(["init", run, "--set", "max_attempts=5", "--set", "release_batch=4"]) == 0
    capsys.readouterr()
    assert cli_main(["init", run, "--set", "max_attempts=6"]) == 1
    assert "refusing to reopen" in capsys.readouterr().err

    assert cli_main(["release", run, data]) == 0
    assert "released 4 rows; cursor at index 4" in capsys.readouterr().out
    assert cli_main(["release", run, data, "--count", "10"]) == 0
    out = capsys.readouterr().out
    assert "released 1 of 2 rows (1 bad dropped" in out
    assert "cursor at index 6 (dataset exhausted)" in out

    q = RunQueue.open(PosixStorage(run))
    (lease,) = q.claim("prod-1")
    q.heartbeat("prod-1")
    q.complete(lease, make_group(lease.task_id, version=0))
    assert cli_main(["status", run]) == 0
    out = capsys.readouterr().out
    assert "pending=4" in out and "ready=1" in out and "dropped=1" in out
    assert "bad_row=1" in out and "prod-1" in out
    assert cli_main(["status", run, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"] == {"pending": 4, "partial": 0, "leased": 0, "ready": 1,
                            "batched": 0, "dropped": 1}
    assert st["cursor"] == {"seq": 2, "next_index": 6, "exhausted": True}
    assert st["heartbeats"] == {"prod-1": 1}

    assert cli_main(["inspect", run, tid(0)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "TASK" and shown["name"]["holder_or_reason"] == "prod-1"
    assert cli_main(["inspect", run, data_key(tid(0), 0, "group"), "--tokens", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "GROUP" and shown["samples"][0]["tokens"] == [1000, 1001]
    assert cli_main(["inspect", run, tid(5)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "DROP" and "invalid JSON" in shown["meta"]["message"]
    assert cli_main(["inspect", run, "i404"]) == 1
    assert "i404" in capsys.readouterr().err
    clobber(PosixStorage(run), f"pending/r-000000000001/{q.find(tid(1))[1]}", b"torn")
    assert cli_main(["inspect", run, tid(1)]) == 1  # a record that fails its checks
    assert "truncated" in json.loads(capsys.readouterr().out)["error"]

    bs = BatchStore(q)
    bs.publish_batch(bs.next_seq(), bs.scan_ready())
    bs.ack(1)
    assert cli_main(["gc", run, "--full"]) == 0
    assert "gc: 1 batches, 1 group payloads" in capsys.readouterr().out


def test_cli_errors_are_messages_not_tracebacks(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["status", str(tmp_path / "nowhere")]) == 1
    assert "strawq init" in capsys.readouterr().err
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"max_attempts": 3, "lease_timeout": 5}))
    assert cli_main(["init", str(tmp_path / "run"), "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "unknown key(s) ['lease_timeout']" in err and "lease_timeout_s" in err
    assert not (tmp_path / "run").exists()
    assert cli_main([]) == 2


def test_departed_producers_heartbeat_files_are_removed(storage: Storage,
                                                        tmp_path: Path) -> None:
    """hb/ stays proportional to live producers: a producer silent for two lease timeouts
    that holds no lease is forgotten; one still holding a lease is kept (its lease expires)."""
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    q.heartbeat("gone")
    q.heartbeat("holder")
    (lease,) = q.claim("holder")
    mon.scan()
    clock.advance(2 * q.config.lease_timeout_s + 1)
    res = mon.scan()
    assert res.expired == [lease.task_id]  # the holder's lease expired this scan
    assert storage.list("hb") == ["holder~0000000000000001"]
    clock.advance(2 * q.config.lease_timeout_s + 1)
    mon.scan()  # now it holds nothing either
    assert storage.list("hb") == []
    assert q.heartbeat("gone") == 2  # a paused one that wakes up carries on (same handle)
    assert mon.observe_heartbeats(clock()) == {"gone": 2}
