"""η as a hard bound (``eta_mode="hard"``, the default): the batch plan that finishes work
in time instead of training it late, dropping it or generating it again.

A group whose oldest token is version m must be trained at a version ≤ m + η: its
*deadline*. A batch formed now is trained at version t (``EtaJudge.trained_at``), the k-th
of the u batches of that version (``k = ahead mod u``). It must leave no group due by t
(deadline ≤ t) for later than version t, so before it is published:

* the ready groups are taken earliest deadline first (for one η this is the staleness-first
  order, ``StalenessOrder``; a mixture source's tighter η moves its groups forward);
* the groups due by t that are still running (pending, partial or leased) are counted, and
  the batch is **held back** while one of them could still go into it and the due groups
  left over would not fit the ``u − 1 − k`` batches that follow it on version t.

The trainer cannot train the batch it has not been given, so it cannot update the weights
past any group's deadline: the hold is where the bound is paid, as trainer wait
(docs/design.md, "What the hard bound costs"). Nothing in the hold is on disk and nothing
of it needs to be: every pass plans again from what the run directory says.

**The oldest version of a running group.** A partial task's key names it (``a<m>``). A
fresh task (no prefix) has no tokens older than the version current when it was released,
so its bound is the version this collector read at the last pass that listed the running
tasks before it first saw the task (a release happens after that read); a task already
running when this collector started is given version 0, which holds a batch for it if it
could be due at all: after a restart the first batches wait for the tasks that were in
flight, never train them late. Under a rolling weight update an engine may serve up to the
published ``max_lag`` versions behind the run's, so a fresh task's bound is lowered by it.

**When the hold cannot help.** A batch made only of due groups, or one with no due group
still running, is published at once: waiting would change nothing. With the default
admission window ((η + 1)·u batches, ``strawq.collector.admission``) every group released
fits the batches trained before its deadline, so that case does not arise; a larger
``admission_batches`` window or a run resumed with more work in flight than the window can
exceed it, and the groups that then miss η are trained and counted (``over_eta``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from strawq.ondisk.names import STAGE_PARTIAL, TaskName
from strawq.storage import Storage
from strawq.tasks.eta import EtaPolicy
from strawq.tasks.states import S, list_queued, names_in
from strawq.weights.publish import WeightStore


def oldest_known(name: TaskName) -> int | None:
    """The oldest token version a running task's name states: a partial's (``a<m>`` with a
    saved prefix), else None (a fresh task, or one sent back to start from scratch)."""
    if name.key.startswith(STAGE_PARTIAL) and name.resume >= 0:
        return name.version
    return None


def running_names(storage: Storage) -> list[TaskName]:
    """The tasks pending, partial or leased (the work that flows into ``ready/``), each
    generation once. ``leased/`` is listed before and after ``pending/``: a task claimed or
    handed back between two listings is still seen once (a caller lists this before it
    scans ``ready/``, so one that completes meanwhile is seen there)."""
    first = names_in(storage, S.LEASED)
    queued = [name for key in list_queued(storage)
              if (name := TaskName.try_parse(key.rsplit("/", 1)[1])) is not None]
    out: dict[tuple[str, int], TaskName] = {}
    for n in [*first, *queued, *names_in(storage, S.LEASED)]:
        out.setdefault((n.id, n.gen), n)
    return list(out.values())


class RunningVersions:
    """The oldest token version of each running task, or a lower bound of it (see the
    module's docstring). Memory: one entry per task in flight."""

    def __init__(self) -> None:
        self._floor: dict[str, int] = {}
        #: the version read at the last pass that listed the running tasks (None: none yet)
        self._listed_at: int | None = None

    def update(self, running: Sequence[TaskName], version: int,
               lag: int = 0) -> dict[str, int]:
        """task id -> oldest token version (or its lower bound) of the ``running`` tasks,
        listed at a pass that read ``version``. ``lag``: versions an engine may lag the
        run's and still serve (a rolling weight update's ``max_lag``): a fresh task may
        start on such an engine, so its bound is that much lower."""
        out: dict[str, int] = {}
        floors: dict[str, int] = {}
        new_floor = 0 if self._listed_at is None else max(0, self._listed_at - lag)
        for n in running:
            key = f"{n.id}~g{n.gen}"  # a lease generation: a requeued task starts afresh
            known = oldest_known(n)
            floor = self._floor.get(key, new_floor) if known is None else known
            floors[key] = floor
            out[n.id] = min(out.get(n.id, floor), floor)
        self._floor = floors
        self._listed_at = version
        return out


@dataclass(frozen=True)
class Plan:
    """What the next batch may be: ``ready`` reordered (due groups first) or held back."""

    ready: list[TaskName]
    hold: bool
    #: the version the batch is trained at, and the groups due by it (ready / running)
    trained_at: int
    due_ready: int
    due_running: int


class DeadlinePlanner:
    """Plans each batch under a hard η (see the module's docstring)."""

    def __init__(self, storage: Storage, policy_of: Callable[[str], EtaPolicy], *,
                 batch_groups: int, batches_per_version: int,
                 running: Callable[[Storage], list[TaskName]] = running_names) -> None:
        self.storage = storage
        self.policy_of = policy_of
        self.batch_groups = batch_groups
        self.batches_per_version = batches_per_version
        self.versions = RunningVersions()
        #: (version, the lag it was published with), read once per version
        self._lag_of: tuple[int, int] | None = None
        self._running = running
        #: batches held back so far (a pass that held counts once)
        self.holds = 0

    def running_oldest(self, version: int) -> dict[str, int]:
        """Each running task's oldest token version (or its bound), listed now."""
        return self.versions.update(self._running(self.storage), version,
                                    self._lag(version))

    def _lag(self, version: int) -> int:
        """The lag ``version`` was published with for engines to pull (rolling weight
        updates, ``strawq.weights.publish``; 0: a bracket), read once per version."""
        if self._lag_of is None or self._lag_of[0] != version:
            m = WeightStore(self.storage).newest()
            self._lag_of = (version, m.max_lag if m is not None and m.version == version
                            else 0)
        return self._lag_of[1]

    def due(self, task_id: str, min_version: int, trained_at: int) -> bool:
        """Must the group be trained at ``trained_at`` or before (trained one version later,
        it would be over its η)?"""
        return self.policy_of(task_id).over(trained_at + 1, min_version)

    def plan(self, ready: list[TaskName], *, version: int, ahead: int,
             running: dict[str, int] | None = None) -> Plan:
        """The plan for a batch formed with ``ahead`` batches before it that the weights do
        not hold yet, at the current ``version``; ``running``: the running tasks' oldest
        versions (listed now when None)."""
        B, u = self.batch_groups, self.batches_per_version
        t = version + ahead // u
        after = (u - 1 - ahead % u) * B  # slots of the batches that follow it on version t
        due = [n for n in ready if self.due(n.id, n.version, t)]
        # earliest deadline first: a tighter η (a mixture source's) moves its groups forward
        due.sort(key=lambda n: n.version + (self.policy_of(n.id).max_staleness or 0))
        due_ids = {n.id for n in due}
        ordered = due + [n for n in ready if n.id not in due_ids]
        if running is None:
            running = self.running_oldest(version)
        ready_ids = {n.id for n in ready}
        due_running = sum(1 for tid, m in running.items()
                          if tid not in ready_ids and self.due(tid, m, t))
        taken = min(len(due), B)
        left = len(due) + due_running - taken
        hold = due_running > 0 and taken < B and left > after
        if hold:
            self.holds += 1
        return Plan(ordered, hold, t, len(due), due_running)
