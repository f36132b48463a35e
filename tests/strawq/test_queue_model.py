"""The queue against an in-memory model (Hypothesis ``RuleBasedStateMachine``).

Rules drive every operation (``regenerate``, the η bound's discard of a claimed partial,
included), including stale lease handles, expiry on an injected clock and
a crash-and-reopen of the collector; after every step the whole run directory is audited
and compared with the model. Invariants: at most one live generation per task, no released
task disappears, each task id enters at most one batch, saved prefixes resume exactly,
attempts and generations follow the model's arithmetic.

Profiles: ``STRAWQ_HYPOTHESIS_PROFILE=strawq-ci`` runs longer; the default stays < 30 s.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery.batches import BatchStore
from strawq.errors import AlreadyExists, LeaseLost
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import CHUNK_PREFIX, TaskName, dataset_task_id
from strawq.storage import MemoryStorage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.states import RELEASE_PREFIX, queued_chunk_keys
from strawq.testing import audit_run, make_group, write_jsonl
from strawq.testing.factories import make_partial, prompts

settings.register_profile("strawq-dev", max_examples=80, stateful_step_count=40,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("strawq-ci", max_examples=150, stateful_step_count=60,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("STRAWQ_HYPOTHESIS_PROFILE", "strawq-dev"))

N_ROWS = 14
BAD_ROWS = {4, 9}
PRODUCERS = ("p1", "p2", "p3")
TIMEOUT = 10.0
MAX_ATTEMPTS = 3


@pytest.fixture(scope="module", autouse=True)
def _list_the_top_at_every_claim() -> Any:
    """The model checks exact priority order at every claim, so the claimer lists the top of
    ``pending/`` at every claim here (as it did while it held fewer than 16 cached names,
    which with 14 rows was always). A task handed back by another process waits at most
    ``TOP_LIST_INTERVAL_S`` for its priority: ``tests/strawq/test_meta_ops.py``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("strawq.tasks.claims.TOP_LIST_INTERVAL_S", 0.0)
        yield


@pytest.fixture(scope="module", autouse=True)
def _dataset_file() -> Any:
    d = tempfile.mkdtemp(prefix="strawq-model-")
    rows: list[Any] = [("{bad json" if i in BAD_ROWS else prompts(1, start=i)[0])
                       for i in range(N_ROWS)]
    QueueMachine.dataset_path = write_jsonl(os.path.join(d, "data.jsonl"), rows)
    yield
    shutil.rmtree(d, ignore_errors=True)


@dataclass
class MTask:
    index: int
    state: str  # queued | leased | ready | batched | dropped | trained
    stage: str = "c"  # queue stage while queued: a (partial), b (returned), c (fresh)
    version: int = 0  # queue-key version (stage a) or ready min version
    gen: int = 0
    attempts: int = 0
    resume: int = -1
    holder: str | None = None
    reason: str | None = None
    prefix: GroupData | None = None
    first_seen: float | None = None

    @property
    def id(self) -> str:
        return dataset_task_id(self.index)


class QueueMachine(RuleBasedStateMachine):
    dataset_path: str = ""

    @initialize(chunk=st.sampled_from([1, 2, 3]))
    def start(self, chunk: int) -> None:
        """``chunk``: the run's ``release_chunk`` (1: a file per task; more: range claims,
        a claim of at least a chunk's size leasing it whole)."""
        self.storage = MemoryStorage()
        cfg = QueueConfig(max_attempts=MAX_ATTEMPTS, lease_timeout_s=TIMEOUT,
                          heartbeat_interval_s=1.0, release_batch=4, release_chunk=chunk,
                          max_bad_row_share=1.0)  # bad rows dropped on purpose
        RunQueue.create(self.storage, cfg)
        self.dataset = Dataset(self.dataset_path)
        self.now = 0.0
        self.tasks: dict[str, MTask] = {}
        self.leases: list[Lease] = []
        self.counters: dict[str, int] = {}
        self.batches: dict[int, list[str]] = {}
        self.acked: set[int] = set()
        self.version = 0
        self.next_index = 0
        self.open_all()

    def open_all(self) -> None:
        """(Re)start the collector side: feeder recovery, batch recovery, a new grantor."""
        self.q = RunQueue.open(self.storage)
        self.feeder = Feeder(self.q, self.dataset)
        if not hasattr(self, "feeder2"):
            self.feeder2 = Feeder(RunQueue.open(self.storage), self.dataset)
        self.bs = BatchStore(self.q)
        self.bs.recover()
        self.counter_owner: dict[str, Any] = {}
        self.monitor = LeaseMonitor(self.q, clock=lambda: self.now)
        self.seen: dict[str, tuple[int, float]] = {}
        for t in self.tasks.values():
            t.first_seen = None

    # -- model helpers -----------------------------------------------------------------------
    def queued_order(self) -> list[MTask]:
        queued = [t for t in self.tasks.values() if t.state == "queued"]
        return sorted(queued, key=lambda t: (t.stage, t.version if t.stage == "a" else 0,
                                             t.index))

    def is_current(self, lease: Lease) -> bool:
        t = self.tasks[lease.task_id]
        return t.state == "leased" and t.gen == lease.gen and t.holder == lease.producer

    def requeue(self, t: MTask, *, refund: bool) -> None:
        t.state, t.holder, t.first_seen = "queued", None, None
        if t.stage == "c":
            t.stage, t.version = "b", 0
        t.gen += 1
        if refund:
            t.attempts = max(t.attempts - 1, 0)

    # -- rules: feeder and producers ---------------------------------------------------------
    @rule(n=st.integers(1, 5), second=st.booleans())
    def release(self, n: int, second: bool) -> None:
        """The collector's feeder, or a second writer of the cursor (an operator's
        ``strawq release`` opened once and kept, so its in-memory cursor goes stale)."""
        got = (self.feeder2 if second else self.feeder).release(n)
        expected = min(n, N_ROWS - self.next_index)
        assert got == expected
        for i in range(self.next_index, self.next_index + got):
            t = MTask(i, "queued")
            if i in BAD_ROWS:
                t.state, t.reason = "dropped", "bad_row"
            self.tasks[t.id] = t
        self.next_index += got

    @rule(producer=st.sampled_from(PRODUCERS), n=st.integers(1, 3))
    def claim(self, producer: str, n: int) -> None:
        # a chunk of fresh tasks (range claims) is leased whole; its tasks past the claim's
        # size are given back at once: returned tasks (gen + 1, no attempt spent)
        chunk_of = {TaskName.parse(key.rsplit("/", 1)[1]).id: chunk
                    for r in self.storage.list("pending") if r.startswith(RELEASE_PREFIX)
                    for k in self.storage.list(f"pending/{r}") if k.startswith(CHUNK_PREFIX)
                    for chunk in [f"pending/{r}/{k}"]
                    for key in queued_chunk_keys(self.storage, chunk)}
        order = self.queued_order()
        expected, given_back = order[:n], []
        last = expected[-1] if expected else None
        if last is not None and last.id in chunk_of:
            given_back = [t for t in order[n:] if chunk_of.get(t.id) == chunk_of[last.id]]
        leases = self.q.claim(producer, n)
        assert [lease.task_id for lease in leases] == [t.id for t in expected]
        for t in given_back:
            t.attempts += 1  # the claim's rename, refunded by the release
            self.requeue(t, refund=True)
        for lease, t in zip(leases, expected, strict=False):
            t.state, t.holder, t.attempts = "leased", producer, t.attempts + 1
            assert (lease.gen, lease.name.attempts, lease.name.resume) == \
                (t.gen, t.attempts, t.resume)
            loaded = self.q.load_partial(lease)
            if t.resume < 0:
                assert loaded is None
            else:  # the saved prefix resumes exactly
                assert loaded is not None and t.prefix is not None
                assert loaded.sample_lens == t.prefix.sample_lens
                for col in ("tokens", "logprobs", "versions", "loss_mask"):
                    np.testing.assert_array_equal(getattr(loaded, col),
                                                  getattr(t.prefix, col))
        self.leases.extend(leases)

    @rule(producer=st.sampled_from(PRODUCERS))
    def heartbeat(self, producer: str) -> None:
        got = self.q.heartbeat(producer)
        if producer in self.counters and self.counter_owner.get(producer) is self.q:
            assert got == self.counters[producer] + 1  # one handle: strictly +1
        else:
            # a reopened handle continues from hb/, or restarts at 1 when the grantor
            # removed a departed producer's file; either way it moves forward from there
            assert got >= 1
        self.counters[producer] = got
        self.counter_owner[producer] = self.q

    def _pick(self, i: int) -> Lease:
        return self.leases[i % len(self.leases)]

    def _stale(self, lease: Lease, op: Any) -> None:
        """A stale handle is fenced: LeaseLost (or, retrying an op that already succeeded
        with this very generation, AlreadyExists from the payload's exclusive create)."""
        with pytest.raises((LeaseLost, AlreadyExists)):
            op()

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10**6))
    def complete(self, i: int) -> None:
        lease = self._pick(i)
        t = self.tasks[lease.task_id]
        prefix = t.prefix if t.resume >= 0 else None
        group = make_group(lease.task_id, t.index, version=self.version, prefix=prefix,
                           lens=(1 + i % 3, i % 2))
        if not self.is_current(lease):
            return self._stale(lease, lambda: self.q.complete(lease, group))
        self.q.complete(lease, group)
        t.state, t.version = "ready", group.min_version()

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10**6))
    def yield_partial(self, i: int) -> None:
        lease = self._pick(i)
        t = self.tasks[lease.task_id]
        prefix = t.prefix if t.resume >= 0 else None
        group = make_partial(lease.task_id, t.index, version=self.version, prefix=prefix,
                             lens=(i % 3, 1))
        if not self.is_current(lease):
            return self._stale(lease, lambda: self.q.yield_partial(lease, group))
        self.q.yield_partial(lease, group)
        t.resume, t.prefix = t.gen, group
        t.stage, t.version = "a", group.min_version()
        self.requeue(t, refund=True)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10**6))
    def release_lease(self, i: int) -> None:
        lease = self._pick(i)
        if not self.is_current(lease):
            return self._stale(lease, lambda: self.q.release(lease))
        self.q.release(lease)
        self.requeue(self.tasks[lease.task_id], refund=True)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10**6), retryable=st.booleans())
    def fail(self, i: int, retryable: bool) -> None:
        lease = self._pick(i)
        if not self.is_current(lease):
            return self._stale(lease, lambda: self.q.fail(lease, "boom", retryable=retryable))
        self.q.fail(lease, "boom", "model failure", retryable=retryable)
        t = self.tasks[lease.task_id]
        if retryable and t.attempts < MAX_ATTEMPTS:
            self.requeue(t, refund=False)
        else:
            t.state, t.holder = "dropped", None
            t.reason = "boom.max_attempts" if retryable else "boom"

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10**6))
    def drop(self, i: int) -> None:
        lease = self._pick(i)
        if not self.is_current(lease):
            return self._stale(lease, lambda: self.q.drop(lease, "filtered"))
        self.q.drop(lease, "filtered", "zero reward variance")
        t = self.tasks[lease.task_id]
        t.state, t.holder, t.reason = "dropped", None, "filtered"

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 10**6))
    def regenerate(self, i: int) -> None:
        """A claimed partial past the η bound, discarded (``eta_mode="regenerate"``)."""
        lease = self._pick(i)
        if not self.is_current(lease):
            return self._stale(lease, lambda: self.q.regenerate(lease, "stale_eta"))
        self.q.regenerate(lease, "stale_eta", "past eta")
        t = self.tasks[lease.task_id]
        # the READY regenerate path's name: version 0, no prefix, gen + 1, the attempt
        # refunded (a regeneration is not a failure)
        t.state, t.holder, t.first_seen = "queued", None, None
        t.stage, t.version = ("a" if t.resume >= 0 else "b"), 0
        t.gen, t.resume, t.prefix = t.gen + 1, -1, None
        t.attempts = max(t.attempts - 1, 0)

    # -- rules: the grantor and the collector ------------------------------------------------
    @rule(dt=st.sampled_from([0.0, 3.0, TIMEOUT / 2, TIMEOUT, TIMEOUT * 3]))
    def advance_clock_and_scan(self, dt: float) -> None:
        self.now += dt
        for p, c in self.counters.items():
            if self.seen.get(p, (None,))[0] != c:
                self.seen[p] = (c, self.now)
        exp_expired, exp_dropped = set(), set()
        holders = {t.holder for t in self.tasks.values() if t.state == "leased"}
        for t in self.tasks.values():
            if t.state != "leased":
                continue
            if t.first_seen is None:
                t.first_seen = self.now
            assert t.holder is not None
            beat = self.seen.get(t.holder)
            last_alive = max(t.first_seen, beat[1]) if beat else t.first_seen
            if self.now - last_alive >= TIMEOUT:
                if t.attempts >= MAX_ATTEMPTS:
                    t.state, t.holder, t.reason = "dropped", None, "lease_expired.max_attempts"
                    exp_dropped.add(t.id)
                else:
                    self.requeue(t, refund=False)
                    exp_expired.add(t.id)
        # a producer silent for two timeouts that held no lease at the scan departs: the
        # grantor forgets it (and removes its heartbeat file), so its next beat, whatever
        # its counter, is a fresh observation
        for p, (_c, changed) in list(self.seen.items()):
            if p not in holders and self.now - changed >= 2 * TIMEOUT:
                del self.seen[p]
        res = self.monitor.scan()
        assert set(res.expired) == exp_expired
        assert set(res.dropped) == exp_dropped

    @rule(v=st.integers(1, 3))
    def set_version(self, v: int) -> None:
        self.version += v
        self.q.set_version(self.version)

    @rule(k=st.integers(1, 4))
    def publish_batch(self, k: int) -> None:
        ready = sorted((t for t in self.tasks.values() if t.state == "ready"),
                       key=lambda t: (t.version, t.index))
        names = self.bs.scan_ready()
        assert [n.id for n in names] == [t.id for t in ready]  # staleness-first, FIFO
        if not names:
            return
        seq = self.bs.next_seq()
        assert seq not in self.batches, "a batch seq was reused"
        self.bs.publish_batch(seq, names[:k])
        self.batches[seq] = [n.id for n in names[:k]]
        for n in names[:k]:
            self.tasks[n.id].state = "batched"

    @precondition(lambda self: set(self.batches) - self.acked)
    @rule(i=st.integers(0, 10**6))
    def ack(self, i: int) -> None:
        unacked = sorted(set(self.batches) - self.acked)
        seq = unacked[i % len(unacked)]
        self.bs.ack(seq)
        self.acked.add(seq)

    @rule(full=st.booleans(), operator=st.booleans())
    def gc(self, full: bool, operator: bool) -> None:
        """The collector's GC, or an operator's ``strawq gc`` (a second GC writer)."""
        (BatchStore(RunQueue.open(self.storage)) if operator else self.bs).gc(full=full)
        for seq in self.acked:
            for tid in self.batches[seq]:
                self.tasks[tid].state = "trained"

    @rule(i=st.integers(0, 10**6), drop=st.booleans())
    def stale_ready(self, i: int, drop: bool) -> None:
        names = self.bs.scan_ready()
        if not names:
            return
        name = names[i % len(names)]
        t = self.tasks[name.id]
        if drop:
            assert self.bs.drop_ready(name, "too_stale")
            t.state, t.reason = "dropped", "too_stale"
        else:
            assert self.bs.requeue_ready(name)
            t.state, t.stage, t.version = "queued", ("a" if t.resume >= 0 else "b"), 0
            t.gen, t.attempts, t.resume, t.prefix = t.gen + 1, max(t.attempts - 1, 0), -1, None
            t.holder = None

    @rule()
    def crash_and_reopen(self) -> None:
        """The collector dies and restarts: in-memory state (grantor observations, cursor
        reader, queue handles) is gone; producers keep their lease handles."""
        self.open_all()

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def storage_matches_model(self) -> None:
        if not hasattr(self, "storage"):
            return
        audit = audit_run(self.storage)
        trained = {tid for tid, t in self.tasks.items() if t.state == "trained"}
        problems = audit.check(self.tasks, trained=trained)
        assert problems == [], problems
        state_dir = {"ready": "ready", "batched": "batched", "dropped": "dropped",
                     "leased": "leased"}
        for tid, t in self.tasks.items():
            if t.state == "trained":
                assert audit.state_of(tid) in (None, "batched")
                continue
            got = audit.state_of(tid)
            want = state_dir.get(t.state) or ("partial" if t.stage == "a" else "pending")
            assert got == want, f"{tid}: storage says {got}, model says {want} ({t})"
            name = audit.name_of(tid)
            if t.state == "dropped":
                assert name.producer == t.reason
                if t.reason == "bad_row":
                    continue
            assert (name.gen, name.attempts, name.resume) == (t.gen, t.attempts, t.resume), \
                f"{tid}: {name} vs model {t}"
            if t.state == "leased":
                assert name.producer == t.holder
            if t.state == "queued" and t.stage == "a":
                assert name.version == t.version
        # each task id enters at most one batch, ever (manifests are deleted by gc)
        ever = [tid for ids in self.batches.values() for tid in ids]
        assert len(ever) == len(set(ever))
        live = sum(1 for t in self.tasks.values() if t.state == "leased")
        assert audit.counts()["leased"] == live  # at most one live generation per task

    def teardown(self) -> None:
        if hasattr(self, "storage"):
            # drain: everything released ends trained or dropped, exactly once
            from strawq.testing.crash import drain
            trained = drain(self.storage, self.dataset, producer="final")
            done = {tid for ids in trained.values() for tid in ids}
            model_trained = {tid for tid, t in self.tasks.items() if t.state == "trained"}
            assert not done & model_trained


QueueMachine.TestCase.settings = PROFILE
TestQueueModel = QueueMachine.TestCase
