"""The in-flight journal on the producer side: one record per window for every held group,
deltas of ``received(sample)``, a park's one record, and the claimer's resume from it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from strawq.producers.group import GroupRun
from strawq.producers.handback import HandBack
from strawq.producers.held import GroupTable
from strawq.producers.journal_flush import load_prefix
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.offload import Offload
from strawq.producers.sample import SamplerParams, received
from strawq.storage import MemoryStorage, Storage
from strawq.tasks.journal import JOURNAL_DIR, journal_dir, read_entries, record_keys
from tests.producers.journal_helpers import (
    flusher,
    generate,
    hold,
    parking,
    run_with_tasks,
    stream,
)


def _entries(storage: Storage, key: str) -> list[dict[str, Any]]:
    return read_entries(storage, key)


def _params(i: int) -> SamplerParams:
    return SamplerParams(max_new_tokens=10_000)


def _same(run: GroupRun, got: GroupRun) -> None:
    for s, t in zip(run.samples, got.samples, strict=True):
        r = received(s)
        for col in ("response_ids", "logprobs", "versions", "loss_mask"):
            np.testing.assert_array_equal(getattr(t, col), getattr(r, col))
        assert t.status == r.status


def test_one_record_per_window_holds_a_delta_of_every_held_group(tmp_path: Path) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 3)
    table = GroupTable()
    groups = hold(q, table, "p1", 3)
    j, io, _book = flusher(q, table, "p1", tokens=5, segments=False)

    async def go() -> None:
        io.start()
        for a in groups:
            assert a.run is not None
            generate(a.run.samples[0], 5)
            stream(a.run.samples[1], 4)  # received, not yet applied
        assert j.unflushed_tokens() == 5 and j.due()  # the most one sequence lacks
        assert await j.flush()
        assert j.unflushed_tokens() == 0 and not j.due()
        a0 = groups[0].run
        assert a0 is not None
        stream(a0.samples[1], 9)  # the streaming segment grew
        generate(a0.samples[0], 2)
        assert await j.flush()
        io.shutdown()

    asyncio.run(go())
    keys = list(reversed(record_keys(storage, "p1")))
    assert len(keys) == 2  # two windows: two records, whatever the number of sequences
    first, second = (_entries(storage, k) for k in keys)
    assert len(first) == 3 and all(e["full"] for e in first)
    assert len(second) == 1 and not second[0]["full"]
    parts = {p["i"]: p for p in second[0]["samples"]}  # type: ignore[attr-defined]
    assert parts[0]["start"] == 5 and len(parts[0]["tokens"]) == 2 * 4
    assert parts[1]["start"] == 4 and len(parts[1]["tokens"]) == 5 * 4


def test_a_claimer_resumes_from_the_journal_prefix_of_an_expired_lease(tmp_path: Path
                                                                      ) -> None:
    from strawq.tasks.grantor import LeaseMonitor
    from tests.strawq.queue_helpers import FakeClock

    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1, version=3)
    j, io, _ = flusher(q, table, "p1")
    run = a.run
    assert run is not None

    async def go() -> None:
        io.start()
        generate(run.samples[0], 6, version=3)
        generate(run.samples[1], 3, version=3, finish="stop")  # final: kept final
        run.rewards[1] = 0.5
        await j.flush()
        stream(run.samples[0], 4, version=4)
        await j.flush()
        io.shutdown()

    asyncio.run(go())
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    mon.scan()
    clock.advance(60)
    assert mon.scan().expired == [a.lease.task_id]
    (lease,) = q.claim("p2")
    assert lease.name.resume == a.lease.gen and lease.journal == "p1"
    assert lease.name.version == 3  # the prefix's oldest version: staleness first
    group = load_prefix(q, lease, _params)
    assert group is not None
    got = GroupRun.from_partial(lease, group, _params)
    _same(run, got)
    assert got.samples[0].response_length == 10 and not got.samples[0].is_final
    assert got.samples[1].is_final and got.rewards[1] == 0.5


def test_an_expired_lease_without_journal_entries_is_requeued_as_before(tmp_path: Path
                                                                        ) -> None:
    from strawq.tasks.grantor import LeaseMonitor
    from tests.strawq.queue_helpers import FakeClock

    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    (lease0,) = q.claim("p1")
    clock = FakeClock()
    mon = LeaseMonitor(q, clock=clock)
    mon.scan()
    clock.advance(60)
    mon.scan()
    (lease,) = q.claim("p2")
    assert lease.name.resume == -1 and lease.journal is None
    assert load_prefix(q, lease, _params) is None


def test_a_park_yields_every_group_into_one_record_and_writes_no_partial(tmp_path: Path
                                                                        ) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 4)
    table, groups, j, io, book, hb = parking(q, "p1", 4)
    publishes: list[str] = []
    inner = storage.publish

    def counting(key: str, data: object, **kw: object) -> None:
        publishes.append(key)
        inner(key, data, **kw)  # type: ignore[arg-type]

    storage.publish = counting  # type: ignore[method-assign]

    async def go() -> None:
        io.start()
        for a in groups:
            assert a.run is not None
            generate(a.run.samples[0], 7)
            stream(a.run.samples[1], 3)
            a.parking = True
        await asyncio.gather(*(hb.yield_partial(a.lease, a.run.to_group(
            producer="p1", version_hint=0, partial=True)) for a in groups if a.run))
        io.shutdown()

    asyncio.run(go())
    assert [k.split("/")[0] for k in publishes] == [JOURNAL_DIR]  # one record, no .partial
    assert book.get("groups_yielded_journal") == 4 and book.get("groups_yielded") == 4
    assert not [k for k in storage.list("data") if k.endswith(".partial")]
    # every group resumes from it, on another producer
    for lease in q.claim("p2", 4):
        assert lease.journal == "p1"
        group = load_prefix(q, lease, _params)
        assert group is not None and group.sample_lens == [7, 3]
    # the parked entries stay (they are the resume point) until the next holders hand back
    assert record_keys(storage, "p1")


def test_hand_backs_delete_the_records_they_supersede(tmp_path: Path) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 2)
    table = GroupTable()
    g1, g2 = hold(q, table, "p1", 2)
    j, io, book = flusher(q, table, "p1")
    hb = HandBack(q, io, StatsBook(ProducerStats(producer_id="p1")))
    hb.journal = j

    async def go() -> None:
        io.start()
        for a in (g1, g2):
            assert a.run is not None
            generate(a.run.samples[0], 4)
        await j.flush()
        assert len(record_keys(storage, "p1")) == 1
        await hb.release(g1.lease)
        assert len(record_keys(storage, "p1")) == 1  # g2's entry is still needed
        await hb.release(g2.lease)
        assert record_keys(storage, "p1") == []
        io.shutdown()

    asyncio.run(go())
    assert storage.list(journal_dir("p1")) == []


def test_nothing_new_writes_no_record(tmp_path: Path) -> None:
    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1")
    io2 = Offload(1, "x")

    async def go() -> None:
        io.start()
        assert not j.due()
        assert await j.flush()  # the first entry of a lease with no token yet: full
        n = len(record_keys(storage, "p1"))
        assert await j.flush()
        assert len(record_keys(storage, "p1")) == n
        io.shutdown()

    asyncio.run(go())
    io2.shutdown()


def test_a_prompt_extra_resumes_row_for_row_across_deltas(tmp_path: Path) -> None:
    """``routed_experts`` has a row per position of prompt + response, its last a
    placeholder until the next segment fills it: a delta replaces the rows from the first
    placeholder on, and the rebuilt sample holds exactly the received rows."""
    from strawq.ondisk.extras import ROUTED_EXPERTS, Extra
    from strawq.producers.sample import Segment, apply_segment

    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 1)
    table = GroupTable()
    (a,) = hold(q, table, "p1", 1)
    j, io, _ = flusher(q, table, "p1")
    run = a.run
    assert run is not None
    s = run.samples[0]
    p = len(s.prompt_ids)

    def seg(n: int, start: int) -> Segment:
        ids = np.arange(n, dtype=np.int32) + 500
        rows = p + s.response_length + n - 1 - start
        return Segment(token_ids=ids, logprobs=np.zeros(n, np.float32),
                       versions=np.zeros(n, np.int64), finish_reason={"type": "abort"},
                       extras={ROUTED_EXPERTS: Extra(np.arange(rows * 2, dtype=np.int32)
                                                     .reshape(rows, 2) + 10 * start)},
                       extras_start=start)

    async def go() -> None:
        io.start()
        apply_segment(s, seg(5, 0))
        await j.flush()
        apply_segment(s, seg(3, s.extras_start(ROUTED_EXPERTS)))
        await j.flush()
        io.shutdown()

    asyncio.run(go())
    entries = [e for k in reversed(record_keys(storage, "p1")) for e in _entries(storage, k)]
    delta = entries[-1]["samples"][0]  # type: ignore[index]
    assert not entries[-1]["full"] and delta["extras"][ROUTED_EXPERTS]["keep"] == p + 4
    from strawq.tasks.journal import load_chain

    from strawq.producers.journal_flush import rebuild

    chain = load_chain(storage, "p1", a.lease.task_id, a.lease.gen)
    assert chain is not None
    got = GroupRun.from_partial(a.lease, rebuild(a.lease, chain, _params, "p1"), _params)
    x, y = got.samples[0].extras[ROUTED_EXPERTS], s.extras[ROUTED_EXPERTS]
    np.testing.assert_array_equal(x.values, y.values)
    _same(run, got)


def test_a_producer_journals_by_default_every_4_s_and_both_keys_0_turn_it_off(
        tmp_path: Path) -> None:
    """The default window is time-only (a record at most every 4 s whatever the decode
    speed); both keys 0: no journal, a park writes a ``.partial`` per group."""
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import (
        EngineConfig,
        PluginsConfig,
        ProducerConfig,
        TimingConfig,
    )
    from tests.producers.helpers import make_run

    make_run(str(tmp_path / "run"), 0, rows=[{"prompt": [4, 5]}])

    def producer(timing: TimingConfig) -> Producer:
        return Producer(ProducerConfig(
            run_dir=str(tmp_path / "run"), engine=EngineConfig(workers=("http://127.0.0.1:9",)),
            plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"), timing=timing))

    on = producer(TimingConfig())
    assert on.journal is not None and on.journal.every_s == 4.0 and on.journal.every_tokens == 0
    assert producer(TimingConfig(journal_every_s=0.0)).journal is None


def test_the_audit_finds_a_parked_prefix_in_the_journal_and_misses_it_once_gone(
        tmp_path: Path) -> None:
    """``strawq.testing.audit``: a group parked into the journal has no ``.partial``; its
    prefix is its writer's journal (queued, and once claimed); without either it is
    reported missing."""
    from strawq.testing.audit import audit_run

    storage = MemoryStorage()
    q = run_with_tasks(storage, tmp_path, 2)
    table, groups, j, io, book, hb = parking(q, "p1", 2)

    async def park() -> None:
        io.start()
        for a in groups:
            assert a.run is not None
            generate(a.run.samples[0], 5)
            a.parking = True
        await asyncio.gather(*(hb.yield_partial(a.lease, a.run.to_group(
            producer="p1", version_hint=0, partial=True)) for a in groups if a.run))
        io.shutdown()

    asyncio.run(park())
    released = {a.lease.task_id for a in groups}
    assert audit_run(storage).check(released) == []
    q.claim("p2", 1)  # one leased (its slot names p2), one still queued
    assert audit_run(storage).check(released) == []
    for key in record_keys(storage, "p1"):
        storage.delete(key)
    problems = audit_run(storage).check(released)
    assert len(problems) == 2 and all(p.endswith(".partial: missing") for p in problems)
