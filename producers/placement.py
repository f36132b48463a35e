"""Producer placement: one pinned, named producer actor per eligible Ray node.

The ONE module that imports Ray and applies ``ray.remote`` / ``.options``. Everything the
actors do is library code (``strawq.producers.producer.Producer``); the reconcile decision is a
pure function (``plan``) over injected node and actor views, so it is testable without a
cluster.

* **Eligible nodes**: alive Ray nodes whose CPU resource is > 0 and at least the actor's
  ``num_cpus``, sorted by (NodeManagerAddress, NodeID) as slime does.
* **Pinning**: ``NodeAffinitySchedulingStrategy(node_id, soft=False)``; no restarts (a dead
  producer's leases expire through the grantor; reconcile starts a fresh one with a new id).
* **Names**: ``strawq-producer-<run_id>-<node_id[:12]>``; an existing live actor of that
  name is adopted, not duplicated (a restarted driver finds its producers).
* **Budget**: K = floor(C*E/G) group slots split by ``divmod(K, W)`` over the W eligible
  nodes (``strawq.producers.budget.split_budget``; C*E < W*G is refused with the numbers),
  recomputed on every reconcile and pushed to each live producer with ``set_slots``.
* **Reconcile** (Ray Serve's proxy-state manager is the model): start producers on nodes
  that joined, retire those whose node died or whose actor died, push the new split.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from strawq.config import Config
from strawq.errors import ConfigError
from strawq.names import validate_id

from strawq.producers.budget import Budget, split_budget
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig, new_producer_id

log = logging.getLogger(__name__)

ACTOR_PREFIX = "strawq-producer"


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


def ray_nodes() -> list[NodeView]:
    return [NodeView(node_id=n["NodeID"], address=str(n.get("NodeManagerAddress", "")),
                     cpus=float(n.get("Resources", {}).get("CPU", 0.0)), alive=bool(n["Alive"]))
            for n in ray.nodes()]  # type: ignore[no-untyped-call]


# -- the actor -----------------------------------------------------------------------------
class ProducerActor:
    """A plain class wrapped by ``ray.remote`` below; holds one ``Producer``.

    Async actor: its methods run on the actor's event loop, which is also the producer's.
    """

    def __init__(self, config: ProducerConfig, node_id: str | None = None) -> None:
        if config.producer_id is None:
            config = dataclasses.replace(config, producer_id=new_producer_id())
        self.producer = Producer(config, node_id=node_id)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start the producer loop (idempotent); returns the producer id."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.producer.run())
        return self.producer.producer_id

    def producer_id(self) -> str:
        return self.producer.producer_id

    def set_slots(self, n: int) -> None:
        self.producer.set_slots(n)

    def stats(self) -> dict[str, Any]:
        d = self.producer.stats().to_dict()
        d["running"] = self._task is not None and not self._task.done()
        d["pid"] = os.getpid()
        return d

    async def stop(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Park every held group (yield partials), stop, and return the final stats."""
        if self._task is not None and not self._task.done():
            self.producer.request_stop()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except asyncio.TimeoutError:
                log.error("producer %s did not stop within %.0fs", self.producer.producer_id,
                          timeout_s)
        return self.stats()


# -- the manager -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PlacementConfig(Config):
    #: Run id used in actor names (``[A-Za-z0-9_.-]``).
    run_id: str
    #: C: concurrent requests per engine.
    concurrency: int
    #: E: number of engines.
    engines: int
    #: G: samples per group (also fills ``ProducerConfig.group_size`` when unset).
    group_size: int
    #: Ray namespace of the named actors (None: the driver's).
    namespace: str | None = None
    #: CPUs each producer actor reserves (slime: 1); a node needs at least this many.
    num_cpus: float = 1.0
    #: Seconds between reconcile passes of ``start_background``.
    reconcile_interval_s: float = 5.0
    #: Deadline of each actor call (start, set_slots, stats).
    call_timeout_s: float = 60.0
    #: Deadline of a producer's stop (it parks its groups first).
    stop_timeout_s: float = 120.0

    def validate(self) -> None:
        validate_id(self.run_id, "run id")
        if self.num_cpus < 0:
            raise ConfigError(f"PlacementConfig.num_cpus must be >= 0, got {self.num_cpus}")
        for name in ("reconcile_interval_s", "call_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"PlacementConfig.{name} must be > 0")


@dataclass
class ReconcileReport:
    started: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    #: node id -> slots pushed
    slots: dict[str, int] = field(default_factory=dict)
    budget: Budget | None = None


class ProducerPlacement:
    """Driver-side manager of the producer actors (one per eligible node)."""

    def __init__(self, producer: ProducerConfig, config: PlacementConfig, *,
                 nodes: Callable[[], list[NodeView]] = ray_nodes) -> None:
        if producer.group_size is None:
            producer = dataclasses.replace(producer, group_size=config.group_size)
        elif producer.group_size != config.group_size:
            raise ConfigError(f"producer group_size {producer.group_size} differs from the "
                              f"placement's G = {config.group_size}")
        self.producer_config = producer
        self.config = config
        self._nodes = nodes
        self.handles: dict[str, Any] = {}
        self.producer_ids: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: Exception | None = None

    # -- actor lifecycle ---------------------------------------------------------------------
    def _options(self, node_id: str) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "name": actor_name(self.config.run_id, node_id),
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
            "num_cpus": self.config.num_cpus,
            "max_restarts": 0,
        }
        if self.config.namespace is not None:
            opts["namespace"] = self.config.namespace
        return opts

    def _lookup(self, node_id: str) -> Any | None:
        try:
            return ray.get_actor(actor_name(self.config.run_id, node_id),
                                 namespace=self.config.namespace)
        except ValueError:
            return None

    def _start(self, node_id: str, slots: int) -> Any:
        handle: Any = self._lookup(node_id)
        if handle is not None:
            try:
                pid = ray.get(handle.start.remote(), timeout=self.config.call_timeout_s)
                log.info("adopted producer %s on node %s", pid, node_id[:12])
                self.handles[node_id], self.producer_ids[node_id] = handle, pid
                return handle
            except (RayActorError, GetTimeoutError):
                handle = None  # a dead one still registered: make a new one
        cfg = dataclasses.replace(self.producer_config, slots=slots,
                                  producer_id=new_producer_id(f"n{node_id[:8]}"))
        deadline = time.monotonic() + self.config.call_timeout_s
        while True:
            try:
                handle = _REMOTE_ACTOR.options(**self._options(node_id)).remote(cfg, node_id)
                break
            except ValueError:  # the name of a dead predecessor is not released yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        pid = ray.get(handle.start.remote(), timeout=self.config.call_timeout_s)
        log.info("started producer %s on node %s with %d slots", pid, node_id[:12], slots)
        self.handles[node_id], self.producer_ids[node_id] = handle, pid
        return handle

    def _retire(self, node_id: str) -> None:
        handle = self.handles.pop(node_id, None)
        pid = self.producer_ids.pop(node_id, None)
        if handle is not None:
            try:  # a live one parks its groups first; a dead one fails at once
                ray.get(handle.stop.remote(self.config.stop_timeout_s),
                        timeout=self.config.stop_timeout_s + 10)
            except Exception as exc:  # noqa: BLE001 - dead or hung: kill it below
                log.debug("stop of producer on %s: %s", node_id[:12], exc)
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - it is already gone
                log.debug("kill of producer on %s: %s", node_id[:12], exc)
        log.warning("retired producer %s of node %s", pid, node_id[:12])

    def _dead_actors(self) -> list[str]:
        """Node ids whose actor no longer answers (killed process, crashed actor)."""
        refs = {nid: h.producer_id.remote() for nid, h in self.handles.items()}
        dead = []
        for nid, ref in refs.items():
            try:
                ray.get(ref, timeout=self.config.call_timeout_s)
            except RayActorError:
                dead.append(nid)
            except GetTimeoutError:
                log.warning("producer on node %s did not answer within %.0fs", nid[:12],
                            self.config.call_timeout_s)
        return dead

    # -- reconcile -----------------------------------------------------------------------------
    def reconcile(self) -> ReconcileReport:
        """One pass: start/retire producers so there is one per eligible node; push slots.

        Raises ``ConfigError`` when C*E < W*G (nothing is started or changed then).
        """
        with self._lock:
            c = self.config
            for nid in self._dead_actors():
                self._retire(nid)
            p = plan(self._nodes(), list(self.handles), min_cpus=c.num_cpus,
                     concurrency=c.concurrency, engines=c.engines, group_size=c.group_size)
            rep = ReconcileReport(budget=p.budget, slots=dict(p.slots))
            for nid in p.retire:
                self._retire(nid)
                rep.retired.append(nid)
            for nid in p.start:
                self._start(nid, p.slots[nid])
                rep.started.append(nid)
            refs = [self.handles[nid].set_slots.remote(n) for nid, n in p.slots.items()
                    if nid in self.handles]
            try:
                ray.get(refs, timeout=c.call_timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                log.warning("pushing slots failed for some producer (%s); next pass retries",
                            exc)
            return rep

    def start_background(self) -> None:
        """Reconcile every ``reconcile_interval_s`` in a daemon thread until ``stop``."""
        def loop() -> None:
            while not self._stop.wait(self.config.reconcile_interval_s):
                try:
                    self.reconcile()
                    self.last_error = None
                except Exception as exc:  # noqa: BLE001 - keep reconciling; report it
                    self.last_error = exc
                    log.error("producer reconcile failed: %s", exc)
        if self._thread is None:
            self._thread = threading.Thread(target=loop, daemon=True,
                                            name="strawq-producer-reconcile")
            self._thread.start()

    def stats(self) -> dict[str, dict[str, Any]]:
        """node id -> the producer's stats (producers that do not answer are left out)."""
        with self._lock:
            refs = {nid: h.stats.remote() for nid, h in self.handles.items()}
        out = {}
        for nid, ref in refs.items():
            try:
                out[nid] = ray.get(ref, timeout=self.config.call_timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                log.warning("no stats from the producer on %s: %s", nid[:12], exc)
        return out

    def stop(self) -> dict[str, dict[str, Any]]:
        """Stop reconciling, stop every producer (they park their groups), kill the actors."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.reconcile_interval_s + self.config.call_timeout_s)
        with self._lock:
            refs = {nid: h.stop.remote(self.config.stop_timeout_s)
                    for nid, h in self.handles.items()}
            out = {}
            for nid, ref in refs.items():
                try:
                    out[nid] = ray.get(ref, timeout=self.config.stop_timeout_s + 10)
                except (RayActorError, GetTimeoutError) as exc:
                    log.warning("producer on %s did not stop cleanly: %s", nid[:12], exc)
            for nid in list(self.handles):
                h = self.handles.pop(nid)
                self.producer_ids.pop(nid, None)
                try:
                    ray.kill(h, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            return out


#: The one place ``ray.remote`` is applied.
_REMOTE_ACTOR: Any = ray.remote(ProducerActor)


def wait_for_nodes(count: int, timeout_s: float = 60.0, min_cpus: float = 1.0) -> list[NodeView]:
    """Block until ``count`` eligible nodes are alive (tests, launch scripts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = eligible(ray_nodes(), min_cpus)
        if len(nodes) >= count:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} eligible Ray nodes after {timeout_s:.0f}s, "
                               f"expected {count}")
        time.sleep(0.2)
