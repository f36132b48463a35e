"""Range claims (``queue.release_chunk``, docs/protocol.md §5): a release stages chunk
directories of k tasks, a claim leases a chunk whole by one rename (and gives back what it
held past its size), and each task leaves it by its own rename — so expiry and completion
still race task by task, with exactly one winner, and a stale holder is fenced.

The interleaving tests follow tests/strawq/test_feeder_writers.py: one party runs on a
``FaultyStorage`` that stops it before its k-th mutation (a paused process), the other runs
whole, then the first resumes; for every k until the first finishes untouched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import pytest

from strawq.errors import ConfigError, LeaseLost
from strawq.data.release_stage import stage_chunk
from strawq.delivery.batches import BatchStore
from strawq.delivery.retention import sweep_staging
from strawq.ondisk.names import CHUNK_ROWS, ChunkName, TaskName, data_key, fresh_key
from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.states import TaskState, count_leased, names_in, upstream_depths
from strawq.testing import audit_run, make_group
from strawq.testing.faults import CrashPoint, FaultyStorage
from strawq.views.status import stray_files
from tests.strawq.queue_helpers import FakeClock, ids, make_feeder, make_queue, tid
from strawq.producers.incarnation import Incarnation

K = 4


@pytest.fixture(params=["memory", "posix"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "memory":
        return MemoryStorage()
    return PosixStorage(str(tmp_path / "run"), fsync=False)


def chunked(storage: Storage, tmp_path: Path, rows: int = K, **cfg: object) -> RunQueue:
    q = make_queue(storage, release_chunk=K, release_batch=rows, **cfg)
    make_feeder(q, tmp_path, rows).release(rows)
    return q


def complete(q: RunQueue, lease: Lease) -> str:
    return q.complete(lease, make_group(lease.task_id, int(lease.task["index"])))


def drain(q: RunQueue) -> None:
    """Another producer claims and completes everything queued."""
    while leases := q.claim("finisher", 16):
        for lease in leases:
            complete(q, lease)
    q.list_pending()  # drained release directories go


def check_each_once(storage: Storage, q: RunQueue, rows: int,
                    interrupted: str | None = None) -> None:
    """Every task is in exactly one state; once drained, each is ready once, nothing is
    left leased (no chunk directory either) and no stale payload stays (but that of a
    completion ``interrupted`` between its payload and its rename: ``gc`` removes it)."""
    assert audit_run(storage).check({tid(i) for i in range(rows)}) == []
    drain(q)
    ready = names_in(storage, TaskState.READY)
    assert sorted(n.id for n in ready) == [tid(i) for i in range(rows)], "lost or twice"
    assert storage.list("leased") == [] and storage.list("pending") == []
    for n in ready:  # a fenced holder's payload of an older generation is gone
        for g in range(n.gen if n.id != interrupted else 0):
            assert not storage.exists(data_key(n.id, g, "group")), (n, g)


def test_a_chunked_release_stages_chunk_directories(storage: Storage, tmp_path: Path) -> None:
    q = chunked(storage, tmp_path, rows=10)
    (release,) = storage.list("pending")
    assert storage.list(f"pending/{release}") == [
        "k-000000000000~n4", "k-000000000001~n4", "k-000000000002~n2"]
    inside = storage.list(f"pending/{release}/k-000000000000~n4")
    assert CHUNK_ROWS in inside and len(inside) == K + 1
    # every task is still an ordinary queued task to readers off the hot path
    assert [k.rsplit("/", 1)[1].split("~")[1] for k in q.list_pending()] == [
        tid(i) for i in range(10)]
    assert upstream_depths(storage).pending == 10
    assert stray_files(q) == []


def test_a_claim_of_a_chunks_size_leases_it_in_one_rename(storage: Storage,
                                                          tmp_path: Path) -> None:
    q = chunked(storage, tmp_path, rows=8)
    faulty = FaultyStorage(storage)
    leases = RunQueue(faulty, q.config).claim("p1", K)
    assert ids(leases) == [tid(i) for i in range(K)]
    assert faulty.counts.get("rename") == 1, "one rename for the whole chunk"
    assert [op for op, _k in faulty.log].count("read") == 1, "the rows read once"
    (held,) = storage.list("leased")
    chunk = ChunkName.try_parse(held)
    assert chunk is not None and (chunk.size, chunk.producer) == (K, "p1")
    assert CHUNK_ROWS not in storage.list(f"leased/{held}"), "rows deleted once read"
    assert all(lease.name.attempts == 1 and lease.producer == "p1" for lease in leases)
    assert all(q.still_held(lease) for lease in leases)
    # counts: leased from the chunk's name (no listing of it), tasks by listing
    assert count_leased(storage) == K and len(names_in(storage, TaskState.LEASED)) == K
    assert upstream_depths(storage).leased == K and upstream_depths(storage).pending == 4
    assert stray_files(q) == []
    # each task leaves by its own rename; the last one out removes the chunk
    for lease in leases:
        complete(q, lease)
    assert storage.list("leased") == []
    check_each_once(storage, q, 8)


def test_a_smaller_claim_leases_the_whole_chunk_and_gives_the_rest_back(
        storage: Storage, tmp_path: Path) -> None:
    q = chunked(storage, tmp_path, rows=K)
    (one,) = q.claim("p1", 1)
    assert one.task_id == tid(0) and one.name.chunk is not None
    # the chunk's other tasks are back in pending/ as returned tasks: gen 1, no attempt spent
    back = names_in(storage, TaskState.PENDING)
    assert sorted(n.id for n in back) == [tid(i) for i in range(1, K)]
    assert all(n.chunk is None and n.gen == 1 and n.attempts == 0 for n in back), back
    rest = RunQueue.open(storage).claim("p2", K)  # another process
    assert ids(rest) == [tid(i) for i in range(1, K)]
    complete(q, one)
    # its chunk directory went with it (the last task out); the rest are ordinary leases
    assert sorted(storage.list("leased")) == sorted(str(lease.name) for lease in rest)
    for lease in rest:
        complete(q, lease)
    check_each_once(storage, q, K)


def test_no_claim_moves_a_task_out_of_a_queued_chunk(tmp_path: Path) -> None:
    """A rename out of a queued chunk by the task's path can resolve the chunk's directory
    just before another claimer renames the whole chunk, and then move the task out of the
    chunk that claimer holds and has listed: the task leased twice (docs/protocol.md §5).
    So every claim leases a chunk whole, whatever its size; the renames a claim makes never
    have a source inside a chunk in pending/."""
    storage = MemoryStorage()
    q = chunked(storage, tmp_path, rows=2 * K)
    sources: list[str] = []
    rename = storage.rename

    def watched(src: str, dst: str, **kw: object) -> None:
        sources.append(src)
        rename(src, dst, **kw)  # type: ignore[arg-type]

    storage.rename = watched  # type: ignore[method-assign]
    leases = [lease for n in (1, 2, 1, K) for lease in q.claim("p1", n)]
    inside = [src for src in sources if src.startswith("pending/") and src.count("/") >= 3]
    assert inside == [], inside
    assert sorted(lease.task_id for lease in leases) == [tid(i) for i in range(2 * K)]
    for lease in leases:
        complete(q, lease)
    check_each_once(storage, q, 2 * K)


def test_a_chunk_claimed_by_single_claims_is_drained(storage: Storage,
                                                     tmp_path: Path) -> None:
    q = chunked(storage, tmp_path, rows=K)
    leases = [lease for _ in range(K) for lease in q.claim("p1", 1)]
    assert sorted(ids(leases)) == [tid(i) for i in range(K)]
    assert q.claim("p1", 1) == []
    q.list_pending()
    assert storage.list("pending") == [], "a drained release directory is removed"


def _expiry_setup(storage: Storage, tmp_path: Path) -> tuple[RunQueue, list[Lease],
                                                              LeaseMonitor, FakeClock]:
    q = chunked(storage, tmp_path, rows=K)
    leases = q.claim("holder", K)
    assert len(leases) == K and all(lease.name.chunk for lease in leases)
    clock = FakeClock()
    monitor = LeaseMonitor(q, clock=clock)
    monitor.scan()  # first sight of the chunk: nothing expires
    assert storage.list("leased") != []
    clock.advance(q.config.lease_timeout_s + 1)  # the holder went silent
    return q, leases, monitor, clock


def _finish(q: RunQueue, leases: list[Lease], done: dict[str, str]) -> None:
    """The holder completes every lease not yet settled; fenced ones are ``lost``."""
    for lease in leases:
        if lease.task_id in done:
            continue
        try:
            complete(q, lease)
            done[lease.task_id] = "won"
        except LeaseLost:
            done[lease.task_id] = "lost"


def _check_outcome(storage: Storage, q: RunQueue, done: dict[str, str],
                   interrupted: str | None = None) -> None:
    assert set(done) == {tid(i) for i in range(K)}
    for task_id, outcome in done.items():
        state, _key, name = q.locate(task_id)
        if outcome == "won":
            assert (state, name.gen) == (TaskState.READY, 0), (task_id, state, name)
        else:  # expired: back in the queue under gen 1, its stale payload removed
            assert (state, name.gen) == (TaskState.PENDING, 1), (task_id, state, name)
            if task_id != interrupted:
                assert not storage.exists(data_key(task_id, 0, "group"))
    check_each_once(storage, q, K, interrupted)


@pytest.mark.parametrize("backend", ["memory", "posix"])
def test_every_interleaving_of_a_holder_paused_inside_a_chunk_and_expiry(
        tmp_path: Path, backend: str) -> None:
    """The holder completes the chunk's tasks one by one and is paused before its k-th
    storage mutation; the grantor expires the chunk; the holder resumes. Each task is won
    by exactly one of them, the stale holder's result is fenced, nothing is lost."""
    seen = 0
    for k in itertools.count(1):
        storage: Storage = (MemoryStorage() if backend == "memory" else
                            PosixStorage(str(tmp_path / f"run{k}"), fsync=False))
        q, leases, monitor, _clock = _expiry_setup(storage, tmp_path)
        paused = RunQueue(FaultyStorage(storage, crash_after=k), q.config)
        done: dict[str, str] = {}
        finished = False
        interrupted = None
        try:
            _finish(paused, leases, done)
            finished = True
        except CrashPoint:
            interrupted = next(x.task_id for x in leases if x.task_id not in done)
            if q.locate(interrupted)[0] is TaskState.READY:
                done[interrupted] = "won"  # paused after its rename (at the chunk's rmdir)
            res = monitor.scan()
            assert set(res.expired).isdisjoint(x for x, o in done.items() if o == "won")
            _finish(q, leases, done)  # the holder wakes up on the real store
        _check_outcome(storage, q, done, interrupted)
        seen += 1
        if finished:
            break
    assert seen > K, "the holder was paused at each of its steps"


def test_every_interleaving_of_an_expiry_paused_inside_a_chunk_and_completion(
        storage: Storage, tmp_path: Path) -> None:
    """The grantor expires the chunk and is paused before its k-th mutation; the holder
    completes every task; the grantor's next pass runs. Exactly one winner per task."""
    seen = 0
    for k in itertools.count(1):
        st: Storage = MemoryStorage() if isinstance(storage, MemoryStorage) else \
            PosixStorage(str(tmp_path / f"run-e{k}"), fsync=False)
        q, leases, monitor, _clock = _expiry_setup(st, tmp_path)
        monitor.queue = RunQueue(FaultyStorage(st, crash_after=k), q.config)
        finished = False
        try:
            monitor.scan()
            finished = True
        except CrashPoint:
            pass
        done: dict[str, str] = {}
        _finish(q, leases, done)
        monitor.queue = q
        monitor.scan()  # the grantor resumes: whatever the holder did not win expires
        assert st.list("leased") == [], "the expired chunk's directory is removed"
        _check_outcome(st, q, done)
        seen += 1
        if finished:
            assert set(done.values()) == {"lost"}
            break
    assert seen > K, "the grantor was paused at each of its steps"


def test_the_grantor_lists_no_chunk_of_a_live_holder(storage: Storage,
                                                      tmp_path: Path) -> None:
    q = chunked(storage, tmp_path, rows=2 * K)
    assert len(q.claim("p1", K)) == K and len(q.claim("p2", K)) == K
    faulty = FaultyStorage(storage)
    clock = FakeClock()
    monitor = LeaseMonitor(RunQueue(faulty, q.config), clock=clock)
    for _ in range(3):
        q.heartbeat("p1")
        q.heartbeat("p2")
        res = monitor.scan()
        clock.advance(1.0)
    assert res.leases == 2 * K and res.expired == []
    listed = [keys[0] for op, keys in faulty.log if op == "list"]
    assert not [d for d in listed if d.startswith("leased/")], listed


def test_an_incarnation_hands_back_its_predecessors_chunk(storage: Storage,
                                                          tmp_path: Path) -> None:
    q = chunked(storage, tmp_path, rows=K)
    Incarnation(q, "p1").begin()
    leases = q.claim("p1", K)
    complete(q, leases[0])
    # p1 restarts: the new process hands back what the old one still held
    again = RunQueue.open(storage)
    back = Incarnation(again, "p1").begin()
    assert sorted(back) == [tid(i) for i in range(1, K)]
    assert storage.list("leased") == [], "the chunk's directory went with its last task"
    for lease in leases[1:]:  # the old process is fenced
        with pytest.raises(LeaseLost):
            complete(q, lease)
    check_each_once(storage, again, K)


def test_an_incarnation_removes_the_empty_chunk_its_predecessor_left(
        storage: Storage, tmp_path: Path) -> None:
    """The holder died after its last task's rename, before the chunk's rmdir."""
    q = chunked(storage, tmp_path, rows=2)
    leases = q.claim("p1", K)
    # each task: its payload (written in place: two crash points, before it and inside
    # it), its rename, an rmdir of the chunk (this handle did not claim it, so it tries
    # each time): dies before the last rmdir
    dying = RunQueue(FaultyStorage(storage, crash_after=4 * len(leases)), q.config)
    with pytest.raises(CrashPoint):
        for lease in leases:
            complete(dying, lease)
    (held,) = storage.list("leased")
    assert storage.list(f"leased/{held}") == [], "every task left: the empty chunk stays"
    assert Incarnation(RunQueue.open(storage), "p1").begin() == []
    assert storage.list("leased") == []
    check_each_once(storage, q, 2)


def test_release_chunk_is_checked() -> None:
    with pytest.raises(ConfigError, match="release_chunk"):
        make_queue(MemoryStorage(), release_chunk=0)
    with pytest.raises(ConfigError, match="longest_first"):
        make_queue(MemoryStorage(), release_chunk=4, longest_first=True)


def test_gc_removes_an_abandoned_staging_with_chunk_directories(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path / "run"), fsync=False)
    make_queue(storage, release_chunk=K)
    tasks = [(TaskName(key=fresh_key(i), id=tid(i), gen=0, attempts=0), {"task": {"index": i}})
             for i in range(2)]
    stage_chunk(storage, "r-000000000005.abcd1234", 0, tasks)  # a release never committed
    assert sweep_staging(storage, grace_s=0) == 3  # two tasks and the rows record
    assert storage.list("staging") == []


class _Syncs(MemoryStorage):
    """Records the directories fsync'd."""

    def __init__(self) -> None:
        super().__init__()
        self.synced: list[str] = []

    def sync_dirs(self, directories: Iterable[str]) -> None:
        self.synced += list(directories)


def test_a_batch_fsyncs_the_held_chunks_a_task_left(tmp_path: Path) -> None:
    """A rename out of a chunk changes the chunk's directory: made durable before a
    manifest names the group, as ``leased/`` is for a lease of its own."""
    storage = _Syncs()
    q = chunked(storage, tmp_path, rows=K)
    leases = q.claim("p1", K)
    complete(q, leases[0])
    (held,) = storage.list("leased")
    bs = BatchStore(q)
    storage.synced.clear()
    bs.publish_batch(bs.next_seq(), bs.scan_ready())
    assert f"leased/{held}" in storage.synced and "ready" in storage.synced
