"""Placement on a real multi-node Ray cluster (one machine, several raylets).

One module-scoped cluster: a head with no CPU (not eligible) and two 1-CPU worker nodes;
a third node is added and removed by the reconcile test. Producers talk to an in-process
sim engine over real HTTP and to a real run directory.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from strawq.errors import ConfigError  # noqa: E402
from strawq.producers.placement import (  # noqa: E402
    PlacementConfig,
    ProducerPlacement,
    actor_name,
    wait_for_nodes,
)
from strawq.producers.producer_config import ProducerConfig  # noqa: E402
from strawq.tasks.grantor import LeaseMonitor  # noqa: E402
from tests.producers.helpers import config_with, ids, make_run, names, ready_groups  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, logging_level="warning",
             namespace="strawq-test")
    c.wait_for_nodes()
    wait_for_nodes(2)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def producer_config(run: str, eng: Any, **sections: Any) -> ProducerConfig:
    base: dict[str, Any] = {
        "run_dir": run, "engine": {"workers": (eng.url,)},
        "plugins": {"reward": "strawq.producers.rewards.count_task"},
        "sampling": {"max_new_tokens": 80, "seed": 5},
        "timing": {"control_poll_s": 0.05, "idle_poll_s": 0.05}}
    return config_with(base, sections)


def until(cond: Any, timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def test_refused_when_engines_cannot_hold_one_group_per_node(
        cluster: Cluster, tmp_path: Path, sim_engine: Any) -> None:
    make_run(str(tmp_path / "run"), 0)
    pl = ProducerPlacement(producer_config(str(tmp_path / "run"), sim_engine),
                           PlacementConfig(run_id="refuse", concurrency=4, engines=1,
                                           num_cpus=0.5))
    with pytest.raises(ConfigError, match=r"C\*E = 4\*1 = 4 < W\*G = 2\*4 = 8"):
        pl.reconcile()
    assert pl.handles == {}
    with pytest.raises(ValueError):
        ray.get_actor(actor_name("refuse", ray.nodes()[0]["NodeID"]))


def test_one_producer_per_node_and_kill_mid_generation(
        cluster: Cluster, tmp_path: Path, sim_engine: Any) -> None:
    """divmod budget, pinned named actors; then kill -9 one producer mid-generation: its
    leases expire (the test is the grantor), the other finishes, every prompt is ready once."""
    n = 40
    run = str(tmp_path / "run")
    q = make_run(run, n, lease_timeout_s=1.5, heartbeat_interval_s=0.2)
    pl = ProducerPlacement(producer_config(run, sim_engine,
                                           sampling={"max_new_tokens": 400, "ignore_eos": True}),
                           PlacementConfig(run_id="kill", concurrency=12, engines=1,
                                           num_cpus=0.5))
    try:
        rep = pl.reconcile()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and
                 n["Resources"].get("CPU", 0) > 0]
        assert sorted(rep.started) == sorted(nodes) and len(nodes) == 2
        assert sorted(rep.slots.values()) == [1, 2]  # K = 12 // 4 = 3 = divmod(3, 2) -> 2, 1
        stats = pl.stats()
        assert {s["node_id"] for s in stats.values()} == set(nodes)
        for nid, s in stats.items():
            assert s["slots"] == rep.slots[nid]
            handle = ray.get_actor(actor_name("kill", nid))
            assert ray.get(handle.producer_id.remote(), timeout=30) == s["producer_id"]
        # the actor really runs on the node it is pinned to
        victim_node = max(rep.slots, key=lambda k: rep.slots[k])
        victim = stats[victim_node]
        until(lambda: any(t.producer == victim["producer_id"] for t in names(q, "leased")),
              60, "the victim holding leases")
        os.kill(victim["pid"], signal.SIGKILL)
        monitor = LeaseMonitor(q)
        expired: list[str] = []
        deadline = time.monotonic() + 120
        while len(ids(q, "ready")) < n:
            expired += monitor.scan().expired
            assert time.monotonic() < deadline, f"only {len(ids(q, 'ready'))} of {n} ready"
            time.sleep(0.1)
        assert expired, "the killed producer's leases never expired"
        assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
        assert not ids(q, "pending") and not ids(q, "leased") and not ids(q, "dropped")
        for g in ready_groups(q).values():
            assert g.sample_lens == [400] * 4
        # reconcile notices the dead actor and starts a fresh producer (new id) on its node
        rep2 = pl.reconcile()
        assert rep2.started == [victim_node]
        assert pl.producer_ids[victim_node] != victim["producer_id"]
    finally:
        pl.stop()


def test_reconcile_follows_nodes_joining_and_leaving(
        cluster: Cluster, tmp_path: Path, sim_engine: Any) -> None:
    run = str(tmp_path / "run")
    make_run(run, 0)
    pl = ProducerPlacement(producer_config(run, sim_engine),
                           PlacementConfig(run_id="recon", concurrency=10, engines=2,
                                           num_cpus=0.5))
    try:
        rep = pl.reconcile()  # K = 20 // 4 = 5 over 2 nodes: 3, 2
        assert sorted(rep.slots.values()) == [2, 3] and len(pl.handles) == 2
        node = cluster.add_node(num_cpus=1)
        wait_for_nodes(3)
        rep = pl.reconcile()  # 5 over 3: 2, 2, 1
        assert len(rep.started) == 1 and sorted(rep.slots.values()) == [1, 2, 2]
        new_node = rep.started[0]
        assert ray.get(pl.handles[new_node].stats.remote(), timeout=30)["node_id"] == new_node
        stats = pl.stats()
        assert {nid: s["slots"] for nid, s in stats.items()} == rep.slots
        cluster.remove_node(node)
        until(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == new_node),
              30, "the node to be marked dead")
        rep = pl.reconcile()
        assert rep.retired == [new_node] or new_node not in pl.handles
        assert new_node not in pl.handles and sorted(rep.slots.values()) == [2, 3]
        stats = pl.stats()
        assert sorted(s["slots"] for s in stats.values()) == [2, 3]
    finally:
        pl.stop()
