"""The collector with a dataset mixture (``strawq.collector.mixing``): each source's filter
and staleness bound act on its groups only, every row stays accounted for, and a source
that loses its share is reported starved with the reason."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.mixing import MixtureBook
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.history import load_history
from strawq.data.mixture import Mixture, open_dataset
from strawq.data.prompt_policy import plan_release
from strawq.delivery.retention import compact_drops, drop_totals
from strawq.errors import ConfigError
from strawq.ondisk.names import TaskName, dataset_task_id
from tests.collector.helpers import SimProducer, train_until_drained

QCFG = QueueConfig(fsync=False, lease_timeout_s=2.0, heartbeat_interval_s=0.2,  # type: ignore
                   release_batch=8, group_size=4)


def drop_every_group(task: dict[str, Any], rewards: list[float]) -> str | None:
    """A source filter for the test: drops every group it sees, naming its source."""
    assert task["source"] == "b" and len(rewards) == 4
    return "filtered_b"


def _mixture(tmp: Path, b: dict[str, Any], sizes: tuple[int, int] = (24, 24)) -> Mixture:
    for name, n in zip("ab", sizes, strict=True):
        with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps({"prompt": [1 + i % 50, 2, 3]}) + "\n")
    spec = tmp / "m.mixture.json"
    spec.write_text(json.dumps({"sources": [{"name": "a", "path": "a.jsonl"},
                                            {"name": "b", "path": "b.jsonl", **b}]}))
    m = open_dataset(str(spec))
    assert isinstance(m, Mixture)
    return m


def _cfg(tmp: Path, **kw: Any) -> CollectorConfig:
    base: dict[str, Any] = {"batch_groups": 4, "max_running": 8, "max_ready": 8,
                            "max_prefetch_batches": 2, "max_staleness": None,
                            "poll_interval_s": 0, "gc_interval_s": 0, "metrics_interval_s": 0,
                            "takeover_timeout_s": 0.05, "metrics_jsonl": str(tmp / "m.jsonl")}
    return CollectorConfig(**{**base, **kw})


def _drive(col: Collector, prod: SimProducer, reader: BatchReader, *,
           on_trained: Any = None) -> list[dict[str, Any]]:
    """Run to the end; the trained groups' summaries, each with its batch's trained_at."""
    trained: list[dict[str, Any]] = []

    def on_batch(b: Any) -> None:
        at = col.batches.read_manifest(b.seq).meta["trained_at"]
        trained.extend({**s, "trained_at": at} for s in b.summaries)
        if on_trained is not None:  # the weights step with the batch it trained
            on_trained()

    assert train_until_drained(col, prod, reader, on_batch)
    return trained


def _last_metrics(tmp: Path) -> dict[str, Any]:
    lines = (tmp / "m.jsonl").read_text().splitlines()
    return dict(json.loads(lines[-1]))


@pytest.mark.timeout(120)
def test_a_sources_filter_drops_only_its_groups_and_starves_it_as_filtered(
        tmp_path: Path) -> None:
    """Over two passes of a mixture of 49 rows (a pass that is no whole number of the
    interleave's periods, so pass 2's rows are not pass 1's indexes' sources): each pass's
    groups are judged by their own row's source."""
    ds = _mixture(tmp_path, {"filter": "tests.collector.test_mixture_collector.drop_every_group"},
                  sizes=(25, 24))
    assert len(ds) == 49
    col = Collector.open(str(tmp_path / "run"), ds, _cfg(tmp_path), queue_config=replace(
        QCFG, num_epochs=2), fsync=False)
    reader = BatchReader.open(str(tmp_path / "run"), checkpointed=False)
    trained = [int(g["index"]) for g in _drive(col, SimProducer(col.queue, "p", slots=8), reader)]
    a_rows = [i for i in range(49) if ds.source_of(i) == "a"]
    assert sorted(trained) == a_rows + [49 + i for i in a_rows]
    assert drop_totals(col.storage).get("filtered_b") == 48
    m = _last_metrics(tmp_path)
    assert m["dataset/a/group_share_total"] == 1.0 and m["dataset/b/trained_groups_total"] == 0
    assert m["dataset/b/filtered_total"] == 48 and m["dataset/b/weight"] == 0.5
    assert m["dataset/b/starved"] == 1 and m["dataset/b/starved_reason"] == "filtered"
    assert m["dataset/a/starved"] == 0
    reader.close()
    col.close()


@pytest.mark.timeout(120)
def test_a_sources_tighter_staleness_bound_drops_only_its_stale_groups(tmp_path: Path) -> None:
    ds = _mixture(tmp_path, {"max_staleness": 0})
    col = Collector.open(str(tmp_path / "run"), ds,
                         _cfg(tmp_path, max_staleness=3, eta_mode="drop"), queue_config=QCFG,
                         fsync=False)
    reader = BatchReader.open(str(tmp_path / "run"), checkpointed=False)
    def step_weights() -> None:  # a trainer: one weight version per batch
        col.queue.set_version(col.queue.current_version() + 1)

    groups = _drive(col, SimProducer(col.queue, "p", slots=8), reader, on_trained=step_weights)
    by_source = {s: [g for g in groups if ds.source_of(int(g["index"])) == s] for s in "ab"}
    rows = {s: [i for i in range(48) if ds.source_of(i) == s] for s in "ab"}
    # a (the run's bound, 3) loses nothing; every b group that would be trained stale is
    # dropped, and every b group trained was trained fresh (b's bound, 0)
    assert sorted(int(g["index"]) for g in by_source["a"]) == rows["a"]
    assert all(g["trained_at"] - g["min_version"] <= 0 for g in by_source["b"])
    assert any(g["trained_at"] - g["min_version"] > 0 for g in by_source["a"])
    dropped = drop_totals(col.storage).get("stale_eta", 0)
    assert dropped > 0 and dropped + len(by_source["b"]) == len(rows["b"])
    m = _last_metrics(tmp_path)
    assert m["dataset/b/stale_total"] == dropped
    if m["dataset/b/starved"]:
        assert m["dataset/b/starved_reason"] == "stale"
    reader.close()
    col.close()


def test_a_source_bound_looser_than_the_runs_is_refused(tmp_path: Path) -> None:
    ds = _mixture(tmp_path, {"max_staleness": 2})
    with pytest.raises(ConfigError, match="only be tighter"):
        Collector.open(str(tmp_path / "run"), ds, _cfg(tmp_path, max_staleness=1),
                       queue_config=QCFG, fsync=False)


def test_starvation_needs_a_real_shortfall_and_says_slow_without_losses(tmp_path: Path) -> None:
    ds = _mixture(tmp_path, {"weight": 1.0})
    book = MixtureBook(ds, run_max_staleness=None, batch_groups=10)

    def train(sources: str) -> None:
        idx = {"a": [i for i in range(48) if ds.source_of(i) == "a"],
               "b": [i for i in range(48) if ds.source_of(i) == "b"]}
        names = [TaskName(key="k", id=dataset_task_id(idx[s][j % 24]), gen=0, attempts=0,
                          resume=-1) for j, s in enumerate(sources)]
        book.on_trained(names, [{"loss_tokens": [5, 5]}] * len(names))

    train("ab" * 5)
    assert book.starved() == {}  # under STARVATION_MIN_BATCHES of groups: no verdict
    train("ab" * 4 + "aa")  # 11 of 20 for b's half: within chance
    assert book.starved() == {}
    train("a" * 40)  # b's groups stop coming, nothing of b was lost: slow
    assert book.starved() == {"b": "slow"}
    m = book.metrics()
    assert m["dataset/b/starved"] == 1 and m["dataset/a/token_share"] > 0.8
    train("ab" * 40)  # the window (8 batches of 10) now holds only these: b is back
    assert book.starved() == {} and len([e for e in book.events if e[1] == "trained"]) == 80
    assert book.metrics()["dataset/b/group_share"] == 0.5


def drop_a(task: dict[str, Any], rewards: list[float]) -> str | None:
    return "filtered_a" if task["source"] == "a" else None


def test_a_group_taken_in_a_filtered_ones_place_is_judged_by_its_own_bound(
        tmp_path: Path) -> None:
    """``eta_mode=drop``: the collector judges η for the groups of the batches it may form
    this pass; when a filter drops some of them, the groups taken in their place lie past
    that range. One of those over its own source's bound must not be trained: it waits,
    and is dropped for η when it is judged."""
    from strawq.testing import make_group

    _mixture(tmp_path, {"max_staleness": 0})  # the files; a's filter added below
    spec = json.loads((tmp_path / "m.mixture.json").read_text())
    spec["sources"][0]["filter"] = "tests.collector.test_mixture_collector.drop_a"
    (tmp_path / "m.mixture.json").write_text(json.dumps(spec))
    ds = open_dataset(str(tmp_path / "m.mixture.json"))
    col = Collector.open(str(tmp_path / "run"), ds,
                         _cfg(tmp_path, batch_groups=2, max_prefetch_batches=1,
                              max_staleness=2, eta_mode="drop"),
                         queue_config=replace(QCFG, group_size=2), fsync=False)
    col.step()  # releases the first rows: 0 a, 1 b, 2 a, 3 b, ...
    leases = {int(x.task["index"]): x for x in col.queue.claim("p", 8)}
    for i in (0, 2, 3, 5):  # a, a, then b, b: ready at version 0, in this order
        col.queue.complete(leases[i], make_group(leases[i].task_id, i, version=0))
    col.queue.set_version(1)
    for _ in range(4):
        col.step()
    trained = [n.id for s in col.batches.batch_seqs()[0]
               for n in col.batches.read_manifest(s).groups]
    assert trained == []  # b's groups are one version old: over b's bound (0)
    assert drop_totals(col.storage) == {"filtered_a": 2, "stale_eta": 2}
    col.close()


def test_a_sources_filter_drop_reaches_the_history_with_its_rewards(tmp_path: Path) -> None:
    """A group a source's filter drops keeps its rewards in the drop's note, so the
    history's zero-variance rule counts it: b's groups (every reward 1.0) are dropped in
    pass 1 and the next pass skips b's rows."""
    from strawq.testing import make_group

    ds = _mixture(tmp_path, {"filter": "tests.collector.test_mixture_collector.drop_every_group"},
                  sizes=(4, 4))
    col = Collector.open(str(tmp_path / "run"), ds, _cfg(tmp_path), queue_config=replace(
        QCFG, num_epochs=2, skip_zero_variance=True), fsync=False)
    col.step()  # releases pass 1: rows 0 a, 1 b, 2 a, ...
    for lease in col.queue.claim("p", 8):
        i = int(lease.task["index"])
        g = make_group(lease.task_id, i, lens=(2, 2, 2, 2))
        g.rewards = [1.0] * 4 if ds.source_of(i) == "b" else [0.0, 1.0, 0.0, 1.0]
        g.meta["source"] = lease.task["source"]  # as a producer's group carries it
        col.queue.complete(lease, g)
    col.step()  # one batch of a's four groups; three of b's were taken and dropped on
    # the way, the fourth waits ready for the next batch
    assert drop_totals(col.storage) == {"filtered_b": 3}
    assert compact_drops(col.storage) == 3
    h = load_history(col.storage)
    b_rows = [i for i in range(8) if ds.source_of(i) == "b"][:3]
    for i in b_rows:
        stats = h.get(dataset_task_id(i))
        assert stats is not None and stats.source == "b"
        (row,) = stats.last
        assert (row["status"], row["reason"], row["reward_mean"], row["rewards_valid"]) == \
            ("dropped", "filtered_b", 1.0, 4)
    plan = plan_release(range(8, 16), lambda i: [[dataset_task_id(i - 8)]], h,
                        skip_zero_variance=True, revisit_epochs=2,
                        longest_first=False)
    assert sorted(s.index - 8 for s in plan.skips) == b_rows
    col.close()


def test_a_source_short_of_rows_the_history_skipped_is_starved_as_skipped(
        tmp_path: Path) -> None:
    """The book's verdict: b's groups stop coming because the history's zero-variance rule
    left its rows out of the releases; the reason is ``skipped``, not ``slow``."""
    ds = _mixture(tmp_path, {})
    book = MixtureBook(ds, run_max_staleness=None, batch_groups=10)
    b_rows = [i for i in range(48) if ds.source_of(i) == "b"]
    book.on_skipped(dataset_task_id(i) for i in b_rows[:20])
    a = [TaskName(key="k", id=dataset_task_id(i), gen=0, attempts=0, resume=-1)
         for i in range(48) if ds.source_of(i) == "a"]
    book.on_trained((a * 2)[:40], [{"loss_tokens": [5]}] * 40)
    assert book.starved() == {"b": "skipped"}
    m = book.metrics()
    assert m["dataset/b/skipped_total"] == 20 and m["dataset/b/starved_reason"] == "skipped"


@pytest.mark.timeout(120)
def test_the_collector_says_skipped_when_the_history_skips_a_sources_rows(
        tmp_path: Path) -> None:
    """Two passes; every group of b agrees (reward 1.0 everywhere), a's do not. The
    trainer keeps step (η 0: a release waits for what is ahead of it to be trained), so
    pass 2 is planned on pass 1's whole history: it skips every row of b, and b's shortfall
    is put down to the skip."""
    from strawq.testing import make_group
    from tests.collector.helpers import FakeClock

    ds = _mixture(tmp_path, {}, sizes=(16, 16))
    clock = FakeClock()
    col = Collector.open(str(tmp_path / "run"), ds,
                         _cfg(tmp_path, batch_groups=2, max_staleness=0,
                              max_prefetch_batches=1),
                         queue_config=replace(QCFG, num_epochs=2, skip_zero_variance=True),
                         fsync=False, clock=clock, sleep=clock.sleep)
    for _ in range(300):
        rep = col.step()
        if rep.drained:
            break
        version = col.queue.current_version()
        for lease in col.queue.claim("p", 8):
            g = make_group(lease.task_id, int(lease.task["index"]), lens=(2, 2, 2, 2),
                           version=version)
            g.rewards = [1.0] * 4 if lease.task["source"] == "b" else [0.0, 1.0, 0.0, 1.0]
            col.queue.complete(lease, g)
        seqs, acked = col.batches.batch_seqs()
        for seq in seqs:
            if seq not in acked:  # the trainer: the batch trained, the weights stepped
                col.batches.ack(seq)
                col.queue.set_version(col.queue.current_version() + 1)
        clock.t += 31.0  # past the pace at which the history is read
    else:
        raise AssertionError("the run did not drain")
    m = _last_metrics(tmp_path)
    assert m["dataset/b/trained_groups_total"] == 16 and m["dataset/a/trained_groups_total"] == 32
    assert m["collector/skipped_zero_variance_total"] == 16
    assert m["dataset/b/starved"] == 1 and m["dataset/b/starved_reason"] == "skipped"
    assert m["dataset/b/skipped_total"] == 16 and m["dataset/a/skipped_total"] == 0
    col.close()

