"""The task-state machine: legal moves, illegal ones, on-disk layout, depths, naming helpers."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from strawq.errors import NotFound
from strawq.ondisk.groups import staleness
from strawq.ondisk.names import (
    STAGE_FRESH,
    STAGE_PARTIAL,
    STAGE_REQUEUED,
    TaskName,
    heartbeat_key,
    parse_heartbeat,
    queue_key,
    ready_key,
    requeued_name,
)
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.queue import DIRS as RUN_DIRS
from strawq.tasks.states import (
    DIRS,
    LEGACY_TRAINED,
    RETIRED,
    TRANSITIONS,
    Depths,
    IllegalTransition,
    TaskState,
    check_transition,
    depths,
    dropped_by_reason,
    key_of,
    move,
    names_in,
    release_dir,
    retire,
    retire_lease,
    upstream_depths,
)

S = TaskState


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    st: Storage = MemoryStorage() if request.param == "memory" else \
        PosixStorage(str(tmp_path / "run"))
    for d in RUN_DIRS:
        st.makedirs(d)
    return st


def name_in(state: TaskState, order: int = 7) -> TaskName:
    """A plausible name of a task in ``state``."""
    base = TaskName(key=queue_key(STAGE_REQUEUED, 0, order), id=f"i{order:012d}", gen=1,
                    attempts=1)
    if state is S.PARTIAL:
        return base.with_(key=queue_key(STAGE_PARTIAL, 3, order), resume=0)
    if state is S.LEASED:
        return base.with_(producer="p0")
    if state in (S.READY, S.BATCHED):
        return base.with_(key=ready_key(3, order), producer="p0")
    if state is S.DROPPED:
        return base.with_(producer="some_reason")
    return base


def put(storage: Storage, state: TaskState, name: TaskName) -> str:
    key = key_of(state, name)
    storage.publish(key, b"x")
    return key


def test_states_have_a_directory_of_the_run_layout() -> None:
    assert set(DIRS) == set(TaskState) - RETIRED
    assert set(DIRS.values()) <= set(RUN_DIRS)
    assert release_dir(3) == "pending/r-000000000003"


@pytest.mark.parametrize("src,dst", sorted(TRANSITIONS, key=lambda t: (t[0].value, t[1].value)),
                         ids=lambda s: s.value)
def test_every_legal_transition_is_one_rename(storage: Storage, src: TaskState,
                                              dst: TaskState) -> None:
    name = name_in(src)
    if src in RETIRED:  # a compacted drop's kept record (strawq.delivery.retention), requeued
        src_key = f"audit/kept/00000001/{name}"
        storage.publish(src_key, b"x")
        new = name_in(dst)
        dst_key = move(storage, name, src, dst, new, src_key=src_key)
        assert storage.exists(dst_key) and not storage.exists(src_key)
        assert names_in(storage, dst) == [new]
        return
    src_key = put(storage, src, name)
    if dst in RETIRED:
        retire(storage, name, src, dst)
        assert not storage.exists(src_key)
        return
    new = name_in(dst)
    dst_key = move(storage, name, src, dst, new)
    assert dst_key == f"{DIRS[dst]}/{new}"
    assert storage.exists(dst_key) and not storage.exists(src_key)
    assert names_in(storage, dst) == [new]


def test_claim_moves_a_fresh_task_out_of_its_release_directory(storage: Storage) -> None:
    fresh = TaskName(key=queue_key(STAGE_FRESH, 0, 4), id="i000000000004", gen=0, attempts=0)
    src_key = f"{release_dir(1)}/{fresh}"
    storage.publish(src_key, b"x")
    assert names_in(storage, S.PENDING) == [fresh]
    held = fresh.with_(attempts=1, producer="p")
    move(storage, fresh, S.PENDING, S.LEASED, held, src_key=src_key)
    assert names_in(storage, S.LEASED) == [held]


@pytest.mark.parametrize("src,dst", [(S.PENDING, S.READY), (S.READY, S.LEASED),
                                     (S.DROPPED, S.READY), (S.PARTIAL, S.DROPPED),
                                     (S.LEASED, S.BATCHED), (S.BATCHED, S.PENDING)],
                         ids=lambda s: s.value)
def test_an_illegal_transition_raises_and_moves_nothing(storage: Storage, src: TaskState,
                                                        dst: TaskState) -> None:
    name = name_in(src)
    src_key = put(storage, src, name)
    with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
        move(storage, name, src, dst, name_in(dst))
    assert storage.exists(src_key)
    with pytest.raises(ValueError):  # IllegalTransition is also a ValueError
        check_transition(src, dst)


def test_a_queued_name_must_carry_its_states_stage_letter(storage: Storage) -> None:
    leased = name_in(S.LEASED)
    put(storage, S.LEASED, leased)
    fresh_key = leased.with_(producer=None)  # stage b: PENDING, not PARTIAL
    with pytest.raises(IllegalTransition, match="stage letter"):
        move(storage, leased, S.LEASED, S.PARTIAL, fresh_key)
    assert names_in(storage, S.LEASED) == [leased]


def test_a_lost_race_is_not_found(storage: Storage) -> None:
    with pytest.raises(NotFound):
        move(storage, name_in(S.LEASED), S.LEASED, S.READY, name_in(S.READY))


def test_depths_count_each_state_and_skip_stray_files(storage: Storage,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    put(storage, S.PENDING, name_in(S.PENDING, 1))
    put(storage, S.PARTIAL, name_in(S.PARTIAL, 2))
    fresh = name_in(S.PENDING, 3).with_(key=queue_key(STAGE_FRESH, 0, 3))
    storage.publish(f"{release_dir(1)}/{fresh}", b"x")
    put(storage, S.LEASED, name_in(S.LEASED, 4))
    put(storage, S.READY, name_in(S.READY, 5))
    put(storage, S.BATCHED, name_in(S.BATCHED, 6))
    put(storage, S.DROPPED, name_in(S.DROPPED, 8))
    for junk in ("pending/junk.txt", "leased/junk.txt", "ready/junk.txt", "dropped/junk.txt"):
        storage.publish(junk, b"not a task")
    want = Depths(pending=2, partial=1, leased=1, ready=1, batched=1)
    with caplog.at_level(logging.WARNING, logger="strawq.tasks.states"):
        assert depths(storage) == want
        assert depths(storage) == want
    warned = [r.getMessage() for r in caplog.records if "junk.txt" in r.getMessage()]
    assert sorted(warned) == sorted(f"ignoring a file that is not a task in the queue: {k}"
                                    for k in ("pending/junk.txt", "leased/junk.txt",
                                              "ready/junk.txt")), "one warning per stray file"
    assert want.running == 4 and want.untrained == 2
    assert dropped_by_reason(storage) == {"some_reason": 1}
    up = upstream_depths(storage)
    assert (up.ready, up.batched) == (0, 0)
    assert depths(storage, upstream=up, ready=9) == Depths(pending=2, partial=1, leased=1,
                                                           ready=9, batched=1)


def test_requeued_names() -> None:
    fresh = TaskName(key=queue_key(STAGE_FRESH, 0, 5), id="i5", gen=2, attempts=3,
                     producer="p")
    back = requeued_name(fresh, refund=True)
    assert back == fresh.with_(key=queue_key(STAGE_REQUEUED, 0, 5), gen=3, attempts=2,
                               producer=None)
    assert requeued_name(fresh, refund=False).attempts == 3
    partial = fresh.with_(key=queue_key(STAGE_PARTIAL, 4, 5), resume=1)
    assert requeued_name(partial, refund=False).key == partial.key  # keeps its priority
    ready = fresh.with_(key=ready_key(4, 5), resume=1)
    again = requeued_name(ready, refund=True, drop_prefix=True)
    assert (again.key, again.resume, again.gen) == (queue_key(STAGE_PARTIAL, 0, 5), -1, 3)
    assert requeued_name(ready.with_(resume=-1), refund=True,
                         drop_prefix=True).key == queue_key(STAGE_REQUEUED, 0, 5)


def test_heartbeat_names_round_trip() -> None:
    key = heartbeat_key("node-1~x", 42)
    assert key == "hb/node-1~x~0000000000000042"
    assert parse_heartbeat(key.split("/", 1)[1]) == ("node-1~x", 42)
    assert parse_heartbeat("junk") is None and parse_heartbeat("p~") is None


def test_staleness_is_current_minus_minimum_version() -> None:
    assert staleness(7, 4) == 3
    assert staleness(7, np.array([7, 5, 8])).tolist() == [0, 2, -1]


def test_a_lease_is_retired_as_trained_by_its_holder_only(storage: Storage) -> None:
    """LEASED -> TRAINED: the holder's entry is deleted; a lease no longer at its key (it
    expired and was re-queued under gen + 1) is NotFound, and the re-queued task stays."""
    held = name_in(S.LEASED)
    put(storage, S.LEASED, held)
    assert check_transition(S.LEASED, S.TRAINED).startswith("retire_lease")
    with pytest.raises(IllegalTransition, match="retire"):
        move(storage, held, S.LEASED, S.TRAINED)
    retire_lease(storage, held)
    assert names_in(storage, S.LEASED) == []
    with pytest.raises(NotFound):  # retried: nothing left to retire, and it says so
        retire_lease(storage, held)
    stale = name_in(S.LEASED, order=8)
    put(storage, S.LEASED, stale)
    requeued = requeued_name(stale, refund=False)
    move(storage, stale, S.LEASED, S.PENDING, requeued)  # the grantor's expiry
    with pytest.raises(NotFound):
        retire(storage, stale, S.LEASED, S.TRAINED)
    assert names_in(storage, S.PENDING) == [requeued]


def test_an_older_runs_trained_drops_are_in_no_dropped_listing(storage: Storage) -> None:
    """An older strawq recorded groups a framework trained as dropped with reason
    ``trained``: they count as trained, so no DROPPED listing returns them."""
    trained = name_in(S.DROPPED).with_(producer=LEGACY_TRAINED)
    bad = name_in(S.DROPPED, order=9)
    put(storage, S.DROPPED, trained)
    put(storage, S.DROPPED, bad)
    assert names_in(storage, S.DROPPED) == [bad]
    assert dropped_by_reason(storage) == {"some_reason": 1}


def test_an_older_runs_trained_drops_are_no_drops_for_the_audit_or_requeue(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without slime installed too: the drop audit's count of an older run's ``trained``
    reason is left out of the totals and ``strawq requeue --reason trained`` refuses."""
    from strawq.delivery.requeue import requeue_dropped
    from strawq.delivery.retention import compact_drops, drop_totals, latest_audit
    from strawq.errors import StrawqError
    from strawq.tasks.queue import RunQueue
    from strawq.views.status import run_status

    q = RunQueue.create(MemoryStorage())
    bad = name_in(S.DROPPED, order=9)
    put(q.storage, S.DROPPED, bad)
    put(q.storage, S.DROPPED, name_in(S.DROPPED, order=4).with_(producer=LEGACY_TRAINED))
    assert compact_drops(q.storage) == 1  # the trained entry is not a drop to fold in
    assert latest_audit(q.storage).counts == {"some_reason": 1}
    put(q.storage, S.DROPPED, name_in(S.DROPPED, order=5).with_(producer=LEGACY_TRAINED))
    with monkeypatch.context() as m:  # an older strawq's compaction folded two in
        import strawq.tasks.states as states

        m.setattr(states, "LEGACY_TRAINED", "not-a-reason", raising=False)
        assert compact_drops(q.storage) == 2
    assert latest_audit(q.storage).counts == {"some_reason": 1, LEGACY_TRAINED: 2}
    assert drop_totals(q.storage) == {"some_reason": 1}
    assert run_status(q).counts["dropped"] == 1
    with pytest.raises(StrawqError, match="train them twice"):
        requeue_dropped(q, LEGACY_TRAINED)
