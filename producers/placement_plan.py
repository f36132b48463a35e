"""Producer placement without Ray: the plan, and the reconcile loop over actor handles.

``strawq.producers.placement`` is the Ray side (``ray.remote``, node listing, actor
handles); everything it decides is decided here, over two small interfaces, so that
reconcile is tested with plain in-process objects (Ray Serve's controller is the model:
its state managers drive actor *wrappers*, and the tests pass fake ones).

* **Eligible nodes**: alive nodes whose CPU resource is > 0 and at least the actor's
  ``num_cpus``, sorted by (address, node id) as slime does.
* **Budget**: K = floor(C*E/G) group slots split by ``divmod(K, W)`` over the W eligible
  nodes (``strawq.producers.budget.split_budget``; C*E < W*G is refused with the
  numbers), recomputed on every reconcile and pushed to each live producer.
* **Reconcile**: retire producers whose actor died, start producers on nodes that joined
  (adopting a live actor of the same name), retire those whose node left, push the split.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from strawq.errors import ConfigError, StrawqError

from strawq.producers.budget import Budget, split_budget
from strawq.producers.placement_config import PlacementConfig
from strawq.producers.producer_config import ProducerConfig, new_producer_id

log = logging.getLogger(__name__)

ACTOR_PREFIX = "strawq-producer"

T_co = TypeVar("T_co", covariant=True)


def actor_name(run_id: str, node_id: str) -> str:
    return f"{ACTOR_PREFIX}-{run_id}-{node_id[:12]}"


@dataclass(frozen=True)
class NodeView:
    node_id: str
    address: str
    cpus: float
    alive: bool = True


def eligible(nodes: Sequence[NodeView], min_cpus: float) -> list[NodeView]:
    """Alive nodes with CPU > 0 and >= ``min_cpus``, in (address, node id) order."""
    out = [n for n in nodes if n.alive and n.cpus > 0 and n.cpus >= min_cpus]
    return sorted(out, key=lambda n: (n.address, n.node_id))


@dataclass(frozen=True)
class Plan:
    start: list[str]
    retire: list[str]
    budget: Budget
    #: node id -> group slots, for every producer that will be live
    slots: dict[str, int]


def plan(nodes: Sequence[NodeView], running: Sequence[str], *, min_cpus: float,
         concurrency: int, engines: int, group_size: int) -> Plan:
    """What reconcile does: start on new eligible nodes, retire on gone ones, re-split K.

    Raises ``ConfigError`` (with the numbers) when C*E < W*G; then nothing changes.
    """
    target = eligible(nodes, min_cpus)
    if not target:
        raise ConfigError(f"no eligible producer node: need an alive Ray node with at least "
                          f"{min_cpus} CPU; nodes seen: "
                          f"{[(n.node_id[:12], n.cpus, n.alive) for n in nodes]}")
    budget = split_budget(concurrency, engines, group_size, len(target))
    ids = [n.node_id for n in target]
    live = set(running)
    return Plan(start=[i for i in ids if i not in live],
                retire=[i for i in running if i not in set(ids)],
                budget=budget, slots=dict(zip(ids, budget.slots, strict=True)))


@dataclass
class ReconcileReport:
    started: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    #: node id -> slots pushed
    slots: dict[str, int] = field(default_factory=dict)
    budget: Budget | None = None


# -- the interfaces -------------------------------------------------------------------------
class ActorDied(StrawqError, RuntimeError):
    """The producer actor is gone (its process died or it was killed)."""


class ActorTimeout(StrawqError, TimeoutError):
    """The producer actor did not answer within the deadline; it may still be alive."""


class Reply(Protocol[T_co]):
    """The answer to one actor call, sent at once and awaited by ``result`` (a Ray
    ``ObjectRef``; a plain value in tests). Sending first and waiting after lets one
    pass talk to every actor concurrently."""

    def result(self, timeout_s: float) -> T_co:
        """The answer; raises ``ActorDied`` or ``ActorTimeout``."""
        ...


class ProducerHandle(Protocol):
    """One producer actor (``placement.ProducerActor``) as the reconciler drives it."""

    def start(self) -> Reply[str]:
        """Start its loop (idempotent); answers the producer id."""
        ...

    def ping(self) -> Reply[str]:
        """Answers the producer id while the actor lives."""
        ...

    def set_slots(self, n: int) -> Reply[None]:
        ...

    def stats(self) -> Reply[dict[str, Any]]:
        ...

    def stop(self, timeout_s: float) -> Reply[dict[str, Any]]:
        """Park its groups, stop, answer the final stats."""
        ...

    def kill(self) -> None:
        """End the actor for good (no restart); never raises."""
        ...


class ProducerLauncher(Protocol):
    """Finds and creates producer actors, one named actor per node."""

    def lookup(self, node_id: str) -> ProducerHandle | None:
        """The live-registered actor of this node's name, if any (a restarted driver)."""
        ...

    def launch(self, node_id: str, config: ProducerConfig) -> ProducerHandle:
        """A new actor pinned to ``node_id`` running a producer of ``config``."""
        ...


# -- the reconciler -------------------------------------------------------------------------
class ProducerFleet:
    """One producer per eligible node, kept so by ``reconcile``; thread-safe."""

    def __init__(self, producer: ProducerConfig, settings: PlacementConfig,
                 launcher: ProducerLauncher, nodes: Callable[[], Sequence[NodeView]], *,
                 group_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.producer_config = producer
        #: the fleet's sizing (C, E) and deadlines
        self.settings = settings
        #: G, the run's ``queue.group_size``
        self.group_size = group_size
        self.launcher = launcher
        #: the cluster's nodes now (listed on each pass, after dead actors are retired)
        self.nodes = nodes
        self.clock = clock
        #: node id -> its producer's handle / producer id
        self.handles: dict[str, ProducerHandle] = {}
        self.producer_ids: dict[str, str] = {}
        self.lock = threading.Lock()

    def reconcile(self) -> ReconcileReport:
        """One pass: start/retire producers so there is one per eligible node; push slots.

        Raises ``ConfigError`` when C*E < W*G (nothing is started or changed then).
        """
        with self.lock:
            s = self.settings
            for nid in self._dead_actors():
                self._retire(nid)
            p = plan(self.nodes(), list(self.handles), min_cpus=s.num_cpus,
                     concurrency=s.concurrency, engines=s.engines, group_size=self.group_size)
            rep = ReconcileReport(budget=p.budget, slots=dict(p.slots))
            for nid in p.retire:
                self._retire(nid)
                rep.retired.append(nid)
            for nid in p.start:
                self._start(nid, p.slots[nid])
                rep.started.append(nid)
            replies = [(nid, self.handles[nid].set_slots(n)) for nid, n in p.slots.items()
                       if nid in self.handles]
            deadline = self.clock() + s.call_timeout_s
            for nid, reply in replies:
                try:
                    reply.result(max(0.0, deadline - self.clock()))
                except (ActorDied, ActorTimeout) as exc:
                    log.warning("pushing slots to the producer on %s failed (%s); next pass "
                                "retries", nid[:12], exc)
            return rep

    def stats(self) -> dict[str, dict[str, Any]]:
        """node id -> the producer's stats (producers that do not answer are left out)."""
        with self.lock:
            replies = {nid: h.stats() for nid, h in self.handles.items()}
        out = {}
        for nid, reply in replies.items():
            try:
                out[nid] = reply.result(self.settings.call_timeout_s)
            except (ActorDied, ActorTimeout) as exc:
                log.warning("no stats from the producer on %s: %s", nid[:12], exc)
        return out

    def stop_all(self) -> dict[str, dict[str, Any]]:
        """Stop every producer (they park their groups), kill the actors; final stats."""
        with self.lock:
            t = self.settings.stop_timeout_s
            replies = {nid: h.stop(t) for nid, h in self.handles.items()}
            out = {}
            for nid, reply in replies.items():
                try:
                    out[nid] = reply.result(t + 10)
                except (ActorDied, ActorTimeout) as exc:
                    log.warning("producer on %s did not stop cleanly: %s", nid[:12], exc)
            for nid in list(self.handles):
                self.handles.pop(nid).kill()
                self.producer_ids.pop(nid, None)
            return out

    # -- one actor ----------------------------------------------------------------------------
    def _start(self, node_id: str, slots: int) -> ProducerHandle:
        handle = self.launcher.lookup(node_id)
        if handle is not None:
            try:
                pid = handle.start().result(self.settings.call_timeout_s)
                log.info("adopted producer %s on node %s", pid, node_id[:12])
                self.handles[node_id], self.producer_ids[node_id] = handle, pid
                return handle
            except (ActorDied, ActorTimeout):
                pass  # a dead one still registered: make a new one
        cfg = dataclasses.replace(
            self.producer_config, budget=dataclasses.replace(self.producer_config.budget,
                                                             slots=slots),
            producer_id=new_producer_id(f"n{node_id[:8]}"))
        handle = self.launcher.launch(node_id, cfg)
        pid = handle.start().result(self.settings.call_timeout_s)
        log.info("started producer %s on node %s with %d slots", pid, node_id[:12], slots)
        self.handles[node_id], self.producer_ids[node_id] = handle, pid
        return handle

    def _retire(self, node_id: str) -> None:
        handle = self.handles.pop(node_id, None)
        pid = self.producer_ids.pop(node_id, None)
        if handle is not None:
            t = self.settings.stop_timeout_s
            try:  # a live one parks its groups first; a dead one fails at once
                handle.stop(t).result(t + 10)
            except Exception as exc:  # noqa: BLE001 - dead or hung: kill it below
                log.debug("stop of producer on %s: %s", node_id[:12], exc)
            handle.kill()
        log.warning("retired producer %s of node %s", pid, node_id[:12])

    def _dead_actors(self) -> list[str]:
        """Node ids whose actor no longer answers (killed process, crashed actor)."""
        replies = {nid: h.ping() for nid, h in self.handles.items()}
        dead = []
        for nid, reply in replies.items():
            try:
                reply.result(self.settings.call_timeout_s)
            except ActorDied:
                dead.append(nid)
            except ActorTimeout:
                log.warning("producer on node %s did not answer within %.0fs", nid[:12],
                            self.settings.call_timeout_s)
        return dead
