"""η as a hard bound (``eta_mode="hard"``, the default; ``strawq.collector.deadlines``): under
random schedules of completions, claims, hand-backs and weight updates, no trained token is
more than η versions old, and nothing is dropped, regenerated or trained twice — the
collector holds a batch back until the groups due by its version are in it, and the
trainer, which updates only after training its batches, waits instead."""

from __future__ import annotations

import numpy as np
import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.deadlines import DeadlinePlanner, RunningVersions
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.ondisk.names import TaskName, queue_key, ready_key
from strawq.storage import MemoryStorage
from strawq.tasks.eta import EtaPolicy
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import SimProducer, write_dataset


def _run(tmp_path, seed: int, *, eta: int, u: int, eta_mode: str | None = None,
         versions: int = 12, rows: int = 400, **queue_kw: object) -> dict[str, object]:
    """One random schedule; returns the trained staleness per sample and the run's counts.
    ``queue_kw``: more ``QueueConfig`` (passes, the history's rules)."""
    rng = np.random.default_rng(seed)
    q = RunQueue.create(MemoryStorage(), QueueConfig(release_batch=8, group_size=4,
                                                     fsync=False, **queue_kw))  # type: ignore
    ds = Dataset(write_dataset(str(tmp_path / f"ds{seed}.jsonl"), rows, seed=seed))
    kw: dict[str, object] = {"batch_groups": 3, "batches_per_version": u, "max_staleness": eta,
                             "max_running": 12, "max_ready": 12, "poll_interval_s": 0,
                             "gc_interval_s": 0, "metrics_interval_s": 1e9,
                             "max_prefetch_batches": int(rng.integers(1, 3))}
    if eta_mode is not None:
        kw["eta_mode"] = eta_mode
    col = Collector(q, ds, CollectorConfig(**kw))  # type: ignore[arg-type]
    col.start(wait=False)
    # long tails: a sample runs 1..40 tokens, a few per producer step
    prods = [SimProducer(q, f"p{i}", slots=int(rng.integers(2, 6)), seed=seed * 10 + i,
                         chunk=int(rng.integers(1, 4)), max_new=(1, 40)) for i in range(2)]
    reader = BatchReader(q, poll_interval_s=0.0)
    stale: list[int] = []
    trained: list[str] = []
    in_version = 0
    for _ in range(6000):
        if rng.random() < 0.7:
            col.step()
        for p in prods:
            for _ in range(int(rng.integers(0, 3))):
                p.step()
        seqs, acked = col.batches.batch_seqs()
        if not any(s not in acked for s in seqs) or rng.random() < 0.3:
            continue
        b = reader.next_batch(timeout=1)
        stale += (b.version - b.sample_min_version.numpy()).tolist()
        trained += [s["task_id"] for s in b.summaries]
        in_version += 1
        update = in_version == u
        for action in rng.permutation(["ack", "update"]):
            if action == "ack":
                reader.ack(b)
            elif update:
                in_version = 0
                if rng.random() < 0.5:  # a global bracket: every held group parked first
                    for p in prods:
                        p.yield_all()
                q.set_version(q.current_version() + 1)  # else generation goes on across it
        if q.current_version() >= versions:
            break
    return {"version": q.current_version(), "stale": stale, "trained": trained,
            "dropped": q.storage.list("dropped"), "totals": col.stale_totals,
            "ranked": q._claimer._ranked}  # claimed by predicted length (claim ranks seen)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(6))
def test_no_trained_token_is_older_than_eta_and_nothing_is_dropped(tmp_path, seed):
    rng = np.random.default_rng(1000 + seed)
    eta, u = int(rng.integers(0, 3)), int(rng.integers(1, 3))
    r = _run(tmp_path, seed, eta=eta, u=u)  # every η setting but the bound is the default
    assert r["version"] >= 12, f"the run trained {r['version']} versions: it stalled"
    assert max(r["stale"]) <= eta, f"trained staleness up to {max(r['stale'])} > eta {eta}"
    assert r["dropped"] == [] and r["totals"] == {"trained": 0, "regenerated": 0,
                                                  "dropped": 0}
    assert len(r["trained"]) == len(set(r["trained"])), "a group was trained twice"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(3))
def test_the_bound_holds_when_producers_claim_longest_predicted_first(tmp_path, seed):
    """The same schedules on a 12-row dataset released for many passes with
    ``longest_first``: from the second pass on, fresh tasks carry claim ranks and are
    claimed by predicted length across releases; the bound still holds, nothing dropped."""
    rng = np.random.default_rng(2000 + seed)
    eta, u = int(rng.integers(0, 3)), int(rng.integers(1, 3))
    r = _run(tmp_path, seed, eta=eta, u=u, rows=12, num_epochs=40, longest_first=True)
    assert r["ranked"], "no release was ranked by predicted length"
    assert r["version"] >= 12, f"the run trained {r['version']} versions: it stalled"
    assert max(r["stale"]) <= eta, f"trained staleness up to {max(r['stale'])} > eta {eta}"
    assert r["dropped"] == [] and r["totals"] == {"trained": 0, "regenerated": 0,
                                                  "dropped": 0}
    assert len(r["trained"]) == len(set(r["trained"])), "a group was trained twice"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_soft_mode_trains_over_eta_on_the_same_schedules(tmp_path):
    """The schedules above are hard ones: ``train`` trains groups over η on them, counted."""
    over = 0
    for seed in range(6):
        rng = np.random.default_rng(1000 + seed)
        eta, u = int(rng.integers(0, 3)), int(rng.integers(1, 3))
        r = _run(tmp_path, seed, eta=eta, u=u, eta_mode="train")
        over += sum(1 for s in r["stale"] if s > eta)
        assert r["dropped"] == []
    assert over > 0


def _ready(index: int, min_version: int) -> TaskName:
    return TaskName(key=ready_key(min_version, index), id=f"i{index:012d}", gen=0, attempts=1)


def _planner(eta: int = 1, u: int = 1, B: int = 2) -> DeadlinePlanner:
    policy = EtaPolicy(eta, "hard")
    return DeadlinePlanner(MemoryStorage(), lambda _t: policy, batch_groups=B,
                           batches_per_version=u, running=lambda _s: [])


def test_a_batch_waits_for_a_running_group_due_by_its_version():
    p = _planner()
    ready = [_ready(1, 5), _ready(2, 5)]
    # trained at 5 with η = 1: a group whose oldest token is 5 can wait for version 6; one
    # of 4 cannot
    assert not p.plan(ready, version=5, ahead=0, running={"i000000000009": 5}).hold
    plan = p.plan(ready, version=5, ahead=0, running={"i000000000009": 4})
    assert plan.hold and plan.due_running == 1 and plan.trained_at == 5


def test_due_groups_go_first_and_a_later_batch_of_the_version_may_take_the_rest():
    p = _planner(u=2)
    ready = [_ready(1, 4), _ready(2, 4), _ready(3, 3)]
    plan = p.plan(ready, version=4, ahead=0, running={"i000000000009": 3})
    # trained at 4, the first of two batches of version 4: the running due group fits the
    # second one
    assert not plan.hold and plan.ready[0].id == "i000000000003"
    assert p.plan(ready, version=4, ahead=1, running={"i000000000009": 3}).hold


def test_a_batch_of_due_groups_only_is_not_held():
    plan = _planner().plan([_ready(1, 2), _ready(2, 2)], version=4, ahead=0,
                           running={"i000000000009": 2})
    assert not plan.hold  # waiting cannot place the running one any earlier


def test_a_fresh_task_is_bounded_by_the_version_read_before_it_was_seen():
    v = RunningVersions()
    fresh = TaskName(key=queue_key("c", 0, 7), id="i000000000007", gen=0, attempts=0)
    partial = TaskName(key=queue_key("a", 3, 8), id="i000000000008", gen=1, attempts=0,
                       resume=0)
    # seen at the first listing of this collector: it may be any age (a restart)
    assert v.update([fresh, partial], 5) == {"i000000000007": 0, "i000000000008": 3}
    newer = TaskName(key=queue_key("c", 0, 9), id="i000000000009", gen=0, attempts=0)
    got = v.update([fresh, newer], 7)
    assert got == {"i000000000007": 0, "i000000000009": 5}


def test_under_a_rolling_update_a_fresh_task_is_bounded_lower_by_the_published_lag():
    v = RunningVersions()
    v.update([], 5)
    fresh = TaskName(key=queue_key("c", 0, 9), id="i000000000009", gen=0, attempts=0)
    # engines may lag the run by one version: a task released after version 5 was read may
    # still start on an engine at version 4
    assert v.update([fresh], 6, lag=1) == {"i000000000009": 4}


def test_the_planner_reads_the_lag_a_version_was_published_with(tmp_path):
    from strawq.storage import PosixStorage
    from strawq.tasks.eta import EtaPolicy
    from strawq.weights.publish import WeightStore

    st = PosixStorage(str(tmp_path / "run"), writer_id="t")
    planner = DeadlinePlanner(st, lambda _id: EtaPolicy(max_staleness=1), batch_groups=2,
                              batches_per_version=1)
    assert planner._lag(3) == 0  # nothing published: a bracket
    w = tmp_path / "w3"
    w.mkdir()
    (w / "model.safetensors").write_bytes(b"x")
    WeightStore(st).publish(3, str(w), wave=1, max_lag=2)
    assert planner._lag(4) == 0 and planner._lag(3) == 2
