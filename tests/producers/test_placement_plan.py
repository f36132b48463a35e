"""Reconcile without Ray: the fleet drives plain in-process handles (Ray Serve's controller
tests are the model). The Ray-backed handles are exercised by ``test_placement.py``."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pytest

from strawq.errors import ConfigError, StrawqError

from strawq.producers.placement_config import PlacementConfig
from strawq.producers.placement_plan import (ActorDied, ActorTimeout, NodeView, ProducerFleet,
                                             eligible, plan)
from strawq.producers.producer_config import EngineConfig, PluginsConfig, ProducerConfig

T = TypeVar("T")


class Done(Generic[T]):
    def __init__(self, value: T, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout_s: float) -> T:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(eq=False)
class FakeProducer:
    node_id: str
    config: ProducerConfig
    slots: int = 0
    alive: bool = True
    hung: bool = False
    starts: int = 0
    stopped: bool = False
    killed: bool = False
    slot_pushes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = self.config.budget.slots

    def _reply(self, value: T) -> Done[T]:
        if not self.alive:
            return Done(value, ActorDied(f"producer on {self.node_id} died"))
        if self.hung:
            return Done(value, ActorTimeout(f"producer on {self.node_id} hung"))
        return Done(value)

    @property
    def pid(self) -> str:
        return self.config.producer_id or "?"

    def start(self) -> Done[str]:
        self.starts += 1
        return self._reply(self.pid)

    def ping(self) -> Done[str]:
        return self._reply(self.pid)

    def set_slots(self, n: int) -> Done[None]:
        if self.alive and not self.hung:
            self.slots = n
            self.slot_pushes.append(n)
        return self._reply(None)

    def stats(self) -> Done[dict[str, Any]]:
        return self._reply({"node_id": self.node_id, "slots": self.slots,
                            "producer_id": self.pid})

    def stop(self, timeout_s: float) -> Done[dict[str, Any]]:
        self.stopped = self.alive
        return self._reply({"slots": self.slots})

    def kill(self) -> None:
        self.killed, self.alive = True, False


class FakeLauncher:
    """Named actors per node, as Ray keeps them: a live one is found by ``lookup``."""

    def __init__(self) -> None:
        self.named: dict[str, FakeProducer] = {}
        self.launched: list[FakeProducer] = []

    def lookup(self, node_id: str) -> FakeProducer | None:
        p = self.named.get(node_id)
        return None if p is None or p.killed else p

    def launch(self, node_id: str, config: ProducerConfig) -> FakeProducer:
        p = FakeProducer(node_id, config)
        self.named[node_id] = p
        self.launched.append(p)
        return p


def node(i: int, cpus: float = 1.0, alive: bool = True) -> NodeView:
    return NodeView(node_id=f"node{i:02d}" + "x" * 20, address=f"10.0.0.{i}", cpus=cpus,
                    alive=alive)


HEAD = node(0, cpus=0.0)  # no CPU: never eligible


def fleet(nodes: list[NodeView], launcher: FakeLauncher | None = None, group_size: int = 4,
          **settings: Any) -> tuple[ProducerFleet, FakeLauncher]:
    launcher = launcher or FakeLauncher()
    cfg = ProducerConfig(
        run_dir="unused",
        engine=EngineConfig(workers=("http://127.0.0.1:9",)),
        plugins=PluginsConfig(reward="tests.producers.plugins_for_tests."
                         "length_reward"))
    placement = PlacementConfig(**{"run_id": "t", "concurrency": 10, "engines": 2,
                                   "call_timeout_s": 5.0, "stop_timeout_s": 5.0, **settings})
    return ProducerFleet(cfg, placement, launcher, lambda: nodes,
                         group_size=group_size), launcher


def test_start_one_per_eligible_node_with_the_divmod_split() -> None:
    nodes = [HEAD, node(2), node(1), node(3, cpus=0.5)]  # node 3: fewer CPUs than num_cpus
    f, launcher = fleet(nodes)  # K = 10*2 // 4 = 5 over 2 nodes
    rep = f.reconcile()
    assert rep.started == [node(1).node_id, node(2).node_id]  # (address, id) order
    assert rep.slots == {node(1).node_id: 3, node(2).node_id: 2}
    assert rep.budget is not None and rep.budget.total == 5
    assert {p.node_id: p.slots for p in launcher.launched} == rep.slots
    assert len({p.pid for p in launcher.launched}) == 2
    assert set(f.producer_ids) == set(rep.slots) and all(p.starts == 1
                                                         for p in launcher.launched)
    assert f.stats() == {p.node_id: {"node_id": p.node_id, "slots": p.slots,
                                     "producer_id": p.pid} for p in launcher.launched}


def test_node_added_starts_one_and_resplits_every_producer() -> None:
    nodes = [HEAD, node(1), node(2)]
    f, launcher = fleet(nodes)
    f.reconcile()
    first = list(launcher.launched)
    nodes.append(node(3))
    rep = f.reconcile()  # 5 over 3: 2, 2, 1
    assert rep.started == [node(3).node_id] and rep.retired == []
    assert rep.slots == {node(1).node_id: 2, node(2).node_id: 2, node(3).node_id: 1}
    assert [p.slot_pushes[-1] for p in first] == [2, 2]  # live ones get the new split
    assert len(launcher.launched) == 3 and not any(p.stopped for p in first)


def test_node_removed_retires_its_producer_and_gives_its_slots_back() -> None:
    nodes = [HEAD, node(1), node(2), node(3)]
    f, launcher = fleet(nodes)
    f.reconcile()
    gone = launcher.named[node(3).node_id]
    nodes[3] = node(3, alive=False)
    rep = f.reconcile()
    assert rep.retired == [node(3).node_id] and rep.started == []
    assert gone.stopped and gone.killed  # parked its groups, then killed
    assert node(3).node_id not in f.handles and node(3).node_id not in f.producer_ids
    assert rep.slots == {node(1).node_id: 3, node(2).node_id: 2}
    assert launcher.named[node(1).node_id].slots == 3


def test_dead_actor_is_replaced_by_a_fresh_producer_with_a_new_id() -> None:
    nodes = [HEAD, node(1), node(2)]
    f, launcher = fleet(nodes)
    f.reconcile()
    victim = launcher.named[node(1).node_id]
    victim.alive = False  # kill -9: the node lives on
    rep = f.reconcile()
    assert rep.started == [node(1).node_id] and rep.retired == []
    fresh = launcher.named[node(1).node_id]
    assert fresh is not victim and fresh.pid != victim.pid
    assert f.producer_ids[node(1).node_id] == fresh.pid and victim.killed


def test_a_hung_actor_is_kept_and_left_out_of_stats() -> None:
    nodes = [HEAD, node(1), node(2)]
    f, launcher = fleet(nodes)
    f.reconcile()
    slow = launcher.named[node(2).node_id]
    slow.hung = True
    rep = f.reconcile()  # a timeout is not a death: no restart, the push is retried later
    assert rep.started == [] and rep.retired == [] and not slow.killed
    assert set(f.stats()) == {node(1).node_id}


def test_refused_when_engines_cannot_hold_one_group_per_node() -> None:
    nodes = [HEAD, node(1), node(2)]
    f, launcher = fleet(nodes, concurrency=4, engines=1)  # C*E = 4 < W*G = 8
    with pytest.raises(ConfigError, match=r"C\*E = 4\*1 = 4 < W\*G = 2\*4 = 8"):
        f.reconcile()
    assert f.handles == {} and launcher.launched == []
    one = [HEAD, node(1)]
    f1, _ = fleet(one, concurrency=4, engines=1)
    f1.reconcile()
    one.append(node(2))  # a node joins and the split no longer fits: nothing changes
    with pytest.raises(ConfigError):
        f1.reconcile()
    assert list(f1.handles) == [node(1).node_id]


def test_no_eligible_node_is_refused_with_what_was_seen() -> None:
    f, launcher = fleet([HEAD])
    with pytest.raises(ConfigError, match="no eligible producer node"):
        f.reconcile()
    assert launcher.launched == []


def test_a_live_actor_of_the_same_name_is_adopted() -> None:
    nodes = [HEAD, node(1)]
    f, launcher = fleet(nodes)
    f.reconcile()
    survivor = launcher.named[node(1).node_id]
    f2, _ = fleet(nodes, launcher)  # a restarted driver
    rep = f2.reconcile()
    assert rep.started == [node(1).node_id] and len(launcher.launched) == 1
    assert f2.handles[node(1).node_id] is survivor and survivor.starts == 2


def test_stop_all_stops_and_kills_every_producer() -> None:
    f, launcher = fleet([HEAD, node(1), node(2)])
    f.reconcile()
    out = f.stop_all()
    assert set(out) == {node(1).node_id, node(2).node_id}
    assert all(p.stopped and p.killed for p in launcher.launched) and f.handles == {}


def test_plan_and_eligibility_are_pure() -> None:
    nodes = [node(2), node(1, alive=False), HEAD, node(3)]
    assert [n.node_id for n in eligible(nodes, 1.0)] == [node(2).node_id, node(3).node_id]
    p = plan(nodes, [node(1).node_id, node(2).node_id], min_cpus=1.0, concurrency=10,
             engines=2, group_size=4)
    assert p.start == [node(3).node_id] and p.retire == [node(1).node_id]
    assert sum(p.slots.values()) == 5


@pytest.mark.process
def test_placement_errors_are_strawq_errors_and_the_plan_needs_no_ray() -> None:
    assert issubclass(ActorDied, StrawqError) and issubclass(ActorDied, RuntimeError)
    assert issubclass(ActorTimeout, StrawqError) and issubclass(ActorTimeout, TimeoutError)
    code = ("import sys, strawq.producers.placement_plan; "
            "assert 'ray' not in sys.modules, 'placement_plan imported ray'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
