"""The collector's η judgement of ready groups: the version each would be trained at, the
bound it is judged by (the run's, or a hook's: a mixture source's), and what ``eta_mode``
does with one over it — keep it and count it (``train``), ``drop`` it or ``regenerate`` it.
``Collector.step`` asks it for the ready groups in order before batches form. Under a hard
η (``eta_mode="hard"``, the default) nothing is dropped or regenerated: its planner
(``strawq.collector.deadlines``) holds a batch back until the groups due by its version are
in it, and the running tasks it plans with are listed here, before ``ready/`` is scanned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from strawq.collector.config import CollectorConfig
from strawq.collector.deadlines import DeadlinePlanner
from strawq.collector.hooks import CollectorHooks
from strawq.collector.ordering import StalenessOrder
from strawq.collector.report import StepReport
from strawq.delivery.batches import BatchStore
from strawq.ondisk.groups import staleness
from strawq.ondisk.names import TaskName
from strawq.tasks.eta import STALE_REASON, EtaPolicy
from strawq.tasks.queue import RunQueue

log = logging.getLogger(__name__)


class EtaJudge:
    """Judges a collector's ready groups against η (see the module's docstring)."""

    def __init__(self, config: CollectorConfig, queue: RunQueue, batches: BatchStore,
                 order: StalenessOrder, hooks: CollectorHooks,
                 policy: Callable[[], EtaPolicy]) -> None:
        self.config = config
        self.queue = queue
        self.batches = batches
        self.order = order
        self.hooks = hooks
        self._policy = policy
        #: the hard bound's batch plan, and the running tasks' oldest versions it plans
        #: with this pass (listed by ``ordered_ready`` when the bound is hard)
        self.deadlines = DeadlinePlanner(queue.storage, self.policy_of,
                                         batch_groups=config.batch_groups,
                                         batches_per_version=config.batches_per_version)
        self.running: dict[str, int] | None = None

    @property
    def policy(self) -> EtaPolicy:
        """The run's η policy."""
        return self._policy()

    def trained_at(self, rep: StepReport, position: int) -> int:
        """The version a ready group at ``position`` (staleness-first) is trained at, at the
        earliest: the current one plus the versions of the batches trained before it whose
        gradient the weights do not hold yet (``rep.ahead``: those of the current version in
        training, those waiting, those formed ahead of it now), u to a version. What was
        trained counts, whatever the order of the weight update, the checkpoint and the ack
        (``strawq.collector.admission``)."""
        ahead = rep.ahead + position // self.config.batch_groups
        return rep.version + ahead // self.config.batches_per_version

    def policy_of(self, task_id: str) -> EtaPolicy:
        """The η policy a task's group is judged by: the run's, with the bound a hook gives
        it (a mixture source's, ``strawq.collector.mixing``)."""
        policy = self.policy
        if not self.hooks.tightens_eta:
            return policy
        eta = self.hooks.eta_of(task_id, policy.max_staleness)
        return policy if eta == policy.max_staleness else EtaPolicy(eta, policy.eta_mode,
                                                                    policy.epoch)

    @property
    def judges(self) -> bool:
        """Some group may get an η verdict: the run's η or a hook's (a mixture source's)."""
        policy = self.policy
        return policy.judges or (policy.eta_mode != "off" and self.hooks.tightens_eta)

    @property
    def hard(self) -> bool:
        """η is a hard bound for some group: the mode is ``hard`` and η is set, the run's
        or a hook's (a mixture source's)."""
        policy = self.policy
        return policy.eta_mode == "hard" and (policy.bounded or self.hooks.tightens_eta)

    def ordered_ready(self, rep: StepReport) -> list[TaskName]:
        """The ready groups staleness-first, less those η drops or regenerates now."""
        hard = self.hard
        # a hard bound plans with the running tasks, listed before ready/ (one that
        # completes in between is then seen in one listing or the other)
        self.running = self.deadlines.running_oldest(rep.version) if hard else None
        scanned = self.batches.scan_ready()
        ready = self.order.order(scanned)
        policy = self.policy
        mode = policy.mode
        if not self.judges or mode in ("train", "hard"):
            return ready  # kept: over-η groups (``train``) are trained and counted
        room = max(self.config.max_prefetch_batches - rep.prefetched, 0)
        keep: list[TaskName] = []
        for n in ready:
            if len(keep) >= room * self.config.batch_groups:
                keep.append(n)  # not batched in this pass: judged when its batch forms
                continue
            at = self.trained_at(rep, len(keep))
            # the cap counts the group's generations, not its failures (a regeneration
            # spends no attempt: TaskName.regenerations)
            generations = n.regenerations + 1
            group_policy = self.policy_of(n.id)
            eta = group_policy.max_staleness
            action = group_policy.action(at, n.version, attempts=generations,
                                         max_attempts=self.queue.config.max_attempts)
            if action is None:
                keep.append(n)
                continue
            stale = staleness(at, n.version)  # the group's: its minimum version
            if action == "train":
                log.info("group %s over eta (staleness %d) was generated %d of %d times: trained "
                         "with its correction, not regenerated again", n.id, stale, generations,
                         self.queue.config.max_attempts)
                keep.append(n)  # counted as over-eta trained when its manifest is written
                continue
            if action == "drop":
                msg = (f"staleness {stale} > eta {eta} (min version {n.version}, trained at "
                       f"{at}, current {rep.version})")
                if self.batches.drop_ready(n, STALE_REASON, msg):
                    rep.dropped_stale.append(n.id)
            elif self.batches.requeue_ready(n, refund=False):  # regenerate: fresh seed
                rep.requeued_stale.append(n.id)
        self.order.forget(rep.dropped_stale + rep.requeued_stale)
        self.hooks.on_stale(rep.dropped_stale + rep.requeued_stale)
        if rep.dropped_stale or rep.requeued_stale:
            log.warning("eta bound %s at version %d (eta_mode=%s): dropped %d, regenerating %d "
                        "stale groups", policy.max_staleness, rep.version, mode,
                        len(rep.dropped_stale), len(rep.requeued_stale))
        return keep
