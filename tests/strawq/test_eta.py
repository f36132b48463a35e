"""The η bound on partial tasks at claim: the policy the collector publishes, the verdict a
claimer draws from it, and ``RunQueue.regenerate`` (memory and POSIX storage)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.errors import ConfigError, LeaseLost
from strawq.ondisk import records
from strawq.ondisk.names import (
    STAGE_PARTIAL,
    STAGE_REQUEUED,
    TaskName,
    data_key,
    note_key,
    queue_key,
)
from strawq.ondisk.records import Kind
from strawq.producers.handback import HandBack
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.offload import Offload
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.eta import STALE_REASON, EtaPolicy, PolicyCache, publish_policy, read_policy
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.states import TaskState
from strawq.testing import write_jsonl
from strawq.testing.factories import make_partial, prompts

N = 4


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "memory":
        return MemoryStorage()
    return PosixStorage(str(tmp_path / "run"), fsync=False)


@pytest.fixture
def dataset(tmp_path: Path) -> Dataset:
    return Dataset(write_jsonl(str(tmp_path / "data.jsonl"), prompts(N)))


def _queue(storage: Storage, dataset: Dataset) -> RunQueue:
    from strawq.data.feeder import Feeder
    q = RunQueue.create(storage, QueueConfig(release_batch=N, fsync=False))
    Feeder(q, dataset).release(N)
    return q


def _partial_lease(q: RunQueue, version: int = 0) -> tuple[Lease, Lease]:
    """Claim a task, yield it as a partial at ``version``, claim the partial: (first, second)."""
    (first,) = q.claim("p1", 1)
    q.yield_partial(first, make_partial(first.task_id, int(first.task["index"]),
                                        version=version))
    (second,) = q.claim("p2", 1)
    assert second.task_id == first.task_id and second.has_partial
    return first, second


# -- the verdict ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode,over", [
    ("train", "train"), ("regenerate", "regenerate"), ("requeue", "regenerate"),
    ("drop", "drop"), ("off", None)])
def test_a_partial_past_eta_gets_the_modes_action(mode: str, over: str | None) -> None:
    policy = EtaPolicy(1, mode)
    assert policy.partial_action(version=3, min_version=1) == over  # staleness 2 > 1
    assert policy.partial_action(version=3, min_version=2) is None  # staleness 1: within
    assert EtaPolicy(None, mode).partial_action(version=10**6, min_version=0) is None


def test_regeneration_stops_at_max_attempts() -> None:
    policy = EtaPolicy(1, "regenerate")
    for attempts, action in ((1, "regenerate"), (2, "regenerate"), (3, "train"), (4, "train")):
        assert policy.partial_action(3, 1, attempts=attempts, max_attempts=3) == action
    # drop is what the user asked for: not softened by the cap
    assert EtaPolicy(1, "drop").partial_action(3, 1, attempts=9, max_attempts=3) == "drop"


def test_a_bad_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="eta_mode"):
        EtaPolicy(1, "ignore")
    with pytest.raises(ConfigError, match="max_staleness"):
        EtaPolicy(-1, "train")


# -- publishing and reading ------------------------------------------------------------------
def test_the_newest_epochs_policy_wins_and_old_ones_are_pruned(storage: Storage) -> None:
    assert read_policy(storage) is None
    publish_policy(storage, EtaPolicy(1, "drop", epoch=1))
    assert read_policy(storage) == EtaPolicy(1, "drop", epoch=1)
    publish_policy(storage, EtaPolicy(1, "train", epoch=1))  # a retried start: first stands
    assert read_policy(storage) == EtaPolicy(1, "drop", epoch=1)
    for e in (2, 3):
        publish_policy(storage, EtaPolicy(e, "regenerate", epoch=e))
    assert read_policy(storage) == EtaPolicy(3, "regenerate", epoch=3)
    assert [n for n in storage.list("collector") if n.startswith("policy-")] == \
        ["policy-000000000002", "policy-000000000003"]


def test_an_unreadable_policy_means_no_check_with_a_warning(
        storage: Storage, caplog: pytest.LogCaptureFixture) -> None:
    storage.makedirs("collector")
    storage.publish("collector/policy-000000000001",
                    records.encode(Kind.STATE, {"max_staleness": 1, "eta_mode": "dorp"}))
    with caplog.at_level(logging.WARNING, logger="strawq.tasks.eta"):
        assert read_policy(storage) is None
    assert "not checked against η at claim" in caplog.text and "dorp" in caplog.text


def test_the_cache_rereads_after_its_interval(storage: Storage) -> None:
    now = [0.0]
    cache = PolicyCache(storage, interval_s=5.0, clock=lambda: now[0])
    assert cache.get() is None
    publish_policy(storage, EtaPolicy(2, "drop", epoch=1))
    now[0] = 4.9
    assert cache.get() is None  # trusted for its interval
    now[0] = 5.0
    assert cache.get() == EtaPolicy(2, "drop", epoch=1)


def test_the_collector_publishes_its_policy_at_start(storage: Storage,
                                                     dataset: Dataset) -> None:
    q = _queue(storage, dataset)
    assert q.eta_policy() is None
    col = Collector(q, dataset, CollectorConfig(max_staleness=1, eta_mode="regenerate"))
    epoch = col.start(wait=False)
    assert read_policy(storage) == EtaPolicy(1, "regenerate", epoch=epoch)
    col.close()
    # a successor with another config supersedes it (its epoch is newer)
    col2 = Collector(RunQueue.open(storage), dataset, CollectorConfig(max_staleness=None))
    epoch2 = col2.start(wait=False)
    assert epoch2 > epoch
    assert read_policy(storage) == EtaPolicy(None, "hard", epoch=epoch2)  # the default mode
    col2.close()


# -- RunQueue.regenerate ---------------------------------------------------------------------
def test_regenerate_discards_the_prefix_counts_a_regeneration_and_notes_why(
        storage: Storage, dataset: Dataset) -> None:
    q = _queue(storage, dataset)
    q.set_version(3)
    first, lease = _partial_lease(q, version=1)
    assert lease.name.key == queue_key(STAGE_PARTIAL, 1, lease.name.order)
    assert (lease.gen, lease.name.attempts, lease.name.resume) == (1, 1, 0)
    partial_key = data_key(lease.task_id, 0, "partial")
    assert storage.exists(partial_key)
    q.regenerate(lease, STALE_REASON, "prefix 2 versions behind")
    state, _key, name = q.locate(lease.task_id)
    # the READY regenerate path's name: partial stage at version 0, no prefix, gen + 1,
    # the claim's attempt refunded and a regeneration counted instead
    assert state is TaskState.PARTIAL
    assert name.key == queue_key(STAGE_PARTIAL, 0, lease.name.order)
    assert (name.gen, name.attempts, name.resume, name.producer) == (2, 0, -1, None)
    assert name.regenerations == 1
    assert not storage.exists(partial_key)
    note = records.decode(storage.read(note_key(lease.task_id, 1, "fail", STALE_REASON)),
                          expect=Kind.FAIL).meta
    assert (note["reason"], note["message"]) == (STALE_REASON, "prefix 2 versions behind")
    # the next lease starts from scratch at a new generation
    (again,) = q.claim("p3", 1)
    assert again.task_id == lease.task_id and not again.has_partial
    assert (again.gen, again.name.attempts, again.name.regenerations) == (2, 1, 1)
    assert q.load_partial(again) is None
    # a stale holder (the first or the second lease) cannot move it any more
    for stale in (first, lease):
        with pytest.raises(LeaseLost):
            q.regenerate(stale, STALE_REASON)
    assert q.locate(lease.task_id)[0] is TaskState.LEASED


def test_regenerate_of_a_task_without_a_prefix_returns_it_to_pending(
        storage: Storage, dataset: Dataset) -> None:
    q = _queue(storage, dataset)
    (lease,) = q.claim("p", 1)
    q.regenerate(lease, STALE_REASON)
    state, _key, name = q.locate(lease.task_id)
    assert state is TaskState.PENDING
    assert name.key == queue_key(STAGE_REQUEUED, 0, lease.name.order)
    assert (name.gen, name.attempts, name.resume, name.regenerations) == (1, 0, -1, 1)


def test_regenerations_do_not_spend_the_failure_budget(
        storage: Storage, dataset: Dataset) -> None:
    """A task regenerated ``max_attempts - 1`` times (the cap) still gets its full failure
    budget: one failure re-queues it, it is not dropped as ``max_attempts``."""
    q = _queue(storage, dataset)
    (lease,) = q.claim("p", 1)
    tid = lease.task_id
    for _ in range(q.config.max_attempts - 1):
        q.regenerate(lease, STALE_REASON)
        (lease,) = q.claim("p", 1)  # requeued work sorts before fresh work
        assert lease.task_id == tid
    assert lease.name.regenerations == q.config.max_attempts - 1 and lease.name.attempts == 1
    q.fail(lease, "engine_rejected", "one real failure")
    state, _key, name = q.locate(tid)
    assert state is TaskState.PENDING, "one failure after regenerations dropped the task"
    assert name.attempts == 1 and name.regenerations == q.config.max_attempts - 1
    # the name round-trips; one without regenerations keeps the plain layout
    assert TaskName.parse(str(name)) == name and ".0~" not in str(lease.name.with_(
        regenerations=0))


def test_handback_counts_regenerated_partials(dataset: Dataset) -> None:
    q = _queue(MemoryStorage(), dataset)
    book = StatsBook(ProducerStats())
    hb = HandBack(q, Offload(1, "t-io"), book)
    _first, lease = _partial_lease(q)

    async def main() -> None:
        await hb.regenerate(lease, STALE_REASON, "past eta")
        await hb.regenerate(lease, STALE_REASON, "past eta")  # fenced off: counted as lost

    asyncio.run(main())
    s = book.snapshot()
    assert (s.partials_regenerated, s.leases_lost) == (1, 1)
    assert s.to_dict()["partials_regenerated"] == 1


def test_a_dropped_partial_is_audited_with_its_reason(storage: Storage,
                                                      dataset: Dataset) -> None:
    q = _queue(storage, dataset)
    _first, lease = _partial_lease(q)
    q.drop(lease, STALE_REASON, "past eta")
    state, _key, name = q.locate(lease.task_id)
    assert state is TaskState.DROPPED and name.producer == STALE_REASON
    note = records.decode(storage.read(note_key(lease.task_id, lease.gen, "drop",
                                                STALE_REASON)), expect=Kind.DROP).meta
    assert note["reason"] == STALE_REASON
