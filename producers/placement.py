"""Producer placement on Ray: one pinned, named producer actor per eligible Ray node.

The ONE module that imports Ray and applies ``ray.remote`` / ``.options``. What the actors
do is library code (``strawq.producers.producer.Producer``); what reconcile decides is
``strawq.producers.placement_plan`` (eligible nodes, the budget split, start/retire/adopt),
which drives actors through the small ``ProducerHandle`` / ``ProducerLauncher`` interfaces
implemented here for Ray — and by plain objects in its tests, without a cluster.

* **Pinning**: ``NodeAffinitySchedulingStrategy(node_id, soft=False)``; no restarts (a dead
  producer's leases expire through the grantor; reconcile starts a fresh one with a new id).
* **Names**: ``strawq-producer-<run_id>-<node_id[:12]>``; an existing live actor of that
  name is adopted, not duplicated (a restarted driver finds its producers).
* **Budget** and **reconcile**: see ``strawq.producers.placement_plan``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from strawq.producers.placement_config import PlacementConfig
from strawq.producers.placement_plan import (
    ACTOR_PREFIX,
    ActorDied,
    ActorTimeout,
    NodeView,
    Plan,
    ProducerFleet,
    ReconcileReport,
    actor_name,
    eligible,
    plan,
)
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig, new_producer_id

__all__ = ["ACTOR_PREFIX", "NodeView", "Plan", "PlacementConfig", "ProducerActor",
           "ProducerPlacement", "ReconcileReport", "actor_name", "eligible", "plan",
           "ray_nodes", "wait_for_nodes"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        self.producer = Producer.from_config(config, node_id=node_id)
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

    async def stop(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Drain: abort every request in flight keeping its tokens, park every held group
        (yield partials), stop, and return the final stats; wait at most ``timeout_s``
        (default: ``timing.grace_period_s``; past it the actor is left running, and
        killing it is a kill: its leases expire)."""
        if timeout_s is None:
            timeout_s = self.producer.config.timing.grace_period_s
        if self._task is not None and not self._task.done():
            self.producer.request_stop()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except asyncio.TimeoutError:
                log.error("producer %s did not stop within %.0fs", self.producer.producer_id,
                          timeout_s)
        return self.stats()


def run_group_size(run_dir: str) -> int:
    """G of the run at ``run_dir`` (its ``QueueConfig``, recorded in ``run.meta``)."""
    from strawq.storage import PosixStorage
    from strawq.tasks.queue import RunQueue

    return RunQueue.open(PosixStorage(run_dir)).config.group_size


# -- Ray behind the placement_plan interfaces --------------------------------------------------
class _RayReply(Generic[T]):
    """An ``ObjectRef`` as a ``placement_plan.Reply``: Ray's errors become ours."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def result(self, timeout_s: float) -> T:
        try:
            value: T = ray.get(self.ref, timeout=timeout_s)
        except RayActorError as exc:
            raise ActorDied(f"producer actor died: {exc}") from exc
        except GetTimeoutError as exc:
            raise ActorTimeout(f"producer actor did not answer within {timeout_s:.0f}s") \
                from exc
        return value


class RayProducerHandle:
    """A ``ProducerActor`` handle as a ``placement_plan.ProducerHandle``."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def start(self) -> _RayReply[str]:
        return _RayReply(self.actor.start.remote())

    def ping(self) -> _RayReply[str]:
        return _RayReply(self.actor.producer_id.remote())

    def set_slots(self, n: int) -> _RayReply[None]:
        return _RayReply(self.actor.set_slots.remote(n))

    def stats(self) -> _RayReply[dict[str, Any]]:
        return _RayReply(self.actor.stats.remote())

    def stop(self, timeout_s: float) -> _RayReply[dict[str, Any]]:
        return _RayReply(self.actor.stop.remote(timeout_s))

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - it is already gone
            log.debug("kill of a producer actor: %s", exc)


class RayLauncher:
    """Named, node-pinned ``ProducerActor``s (a ``placement_plan.ProducerLauncher``)."""

    def __init__(self, config: PlacementConfig) -> None:
        self.config = config

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

    def lookup(self, node_id: str) -> RayProducerHandle | None:
        try:
            return RayProducerHandle(ray.get_actor(actor_name(self.config.run_id, node_id),
                                                   namespace=self.config.namespace))
        except ValueError:
            return None

    def launch(self, node_id: str, config: ProducerConfig) -> RayProducerHandle:
        deadline = time.monotonic() + self.config.call_timeout_s
        while True:
            try:
                return RayProducerHandle(
                    _REMOTE_ACTOR.options(**self._options(node_id)).remote(config, node_id))
            except ValueError:  # the name of a dead predecessor is not released yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


# -- the manager -----------------------------------------------------------------------------
class ProducerPlacement:
    """Driver-side manager of the producer actors (one per eligible node)."""

    def __init__(self, producer: ProducerConfig, config: PlacementConfig, *,
                 group_size: int | None = None,
                 nodes: Callable[[], list[NodeView]] = ray_nodes) -> None:
        self.producer_config = producer
        self.config = config
        #: G, held once in the run's ``QueueConfig``: read from the run unless given
        self.group_size = run_group_size(producer.run_dir) if group_size is None else group_size
        self.fleet = ProducerFleet(producer, config, RayLauncher(config), nodes,
                                   group_size=self.group_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: Exception | None = None

    @property
    def handles(self) -> dict[str, Any]:
        """node id -> its producer's Ray actor handle."""
        with self.fleet.lock:
            return {nid: h.actor for nid, h in self.fleet.handles.items()
                    if isinstance(h, RayProducerHandle)}

    @property
    def producer_ids(self) -> dict[str, str]:
        """node id -> its producer's id."""
        with self.fleet.lock:
            return dict(self.fleet.producer_ids)

    def reconcile(self) -> ReconcileReport:
        """One pass: start/retire producers so there is one per eligible node; push slots.

        Raises ``ConfigError`` when C*E < W*G (nothing is started or changed then).
        """
        return self.fleet.reconcile()

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
        return self.fleet.stats()

    def stop(self) -> dict[str, dict[str, Any]]:
        """Stop reconciling, stop every producer (they park their groups), kill the actors."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.reconcile_interval_s + self.config.call_timeout_s)
        return self.fleet.stop_all()


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


@contextlib.contextmanager
def _ray_address_file_kept() -> Iterator[None]:
    """Restore the host's ``ray_current_cluster`` file, or its absence, on exit."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    try:
        before: bytes | None = path.read_bytes()
    except FileNotFoundError:
        before = None
    try:
        yield
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)


class LocalCluster:
    """A Ray cluster of ``nodes`` one-CPU nodes in this machine's processes (demo and lab)."""

    def __init__(self, nodes: int) -> None:
        from ray.cluster_utils import Cluster

        # Ray's test cluster records its address in the host's ``ray_current_cluster``
        # file, which a later bare ``ray.init()`` on this host joins. This cluster is
        # private and this driver connects by address, so the file is put back as it was:
        # a demo killed with -9 would otherwise leave it naming a dead cluster, and the
        # next ``ray.init(num_cpus=...)`` here would fail.
        with _ray_address_file_kept():
            self._cluster = Cluster(initialize_head=True,
                                    head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(nodes - 1):
            self._cluster.add_node(num_cpus=1)
        ray.init(address=self._cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        self._cluster.wait_for_nodes()

    def shutdown(self) -> None:
        """Disconnect this driver and stop every node."""
        if ray.is_initialized():
            ray.shutdown()
        with _ray_address_file_kept():  # Ray's shutdown deletes the file, whoever wrote it
            self._cluster.shutdown()  # type: ignore[no-untyped-call]


def start_local_cluster(nodes: int) -> LocalCluster:
    """Start a local multi-node Ray cluster and connect this driver to it."""
    return LocalCluster(nodes)
