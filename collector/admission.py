"""Admission control: how many new prompt groups the feeder may release now.

The staleness rule (docs/design.md, "Sizing") in the form the collector evaluates::

    untrained + running < (η + 1)·B·u          (u = batches per version)

where *untrained* = ready groups + batched groups whose gradient the weights do not hold yet
(below) and *running* = pending + leased + partial. The collector evaluates this form: it
only needs what is on disk now, it survives restarts, and a run resumed at version 37 on a
fresh queue does not admit (η + 38)·B groups in one burst (AReaL PR #1345). Why it bounds
staleness: a group released now is trained after the ``untrained + running`` groups ahead
of it, i.e. at most η versions from now, and its tokens carry versions ≥ the current one.
Groups a filter drops leave both counts at once, so their capacity is free again at once.

**What was trained counts, not when it was acked.** A batch's groups stop counting as
untrained when the weights hold their gradient, whatever the order in which the trainer
updates the weights, saves its checkpoint and acks (``Progress``). Rank 0's reader marks every
batch it delivers with the version current then (``strawq.delivery.batches.mark_delivered``):

* delivered at a version *older* than the current one: trained into the current weights
  (consumed), acked or not;
* delivered at the current version: being trained on it, its update still to come: it
  counts, acked or not, as one of the ``in_training`` batches T (``T·B`` groups, whether
  GC collected its entries or not; at most u of them, the batches one version trains);
* never delivered: untrained until acked (an ack without a delivery mark is a batch the
  trainer consumed without training it, or a consumer that does not mark deliveries).

With T batches of the current version in training the rule is
``ready + untrained batched + running < ((η + 1)·u − T)·B``: a group released now has fewer
than ``(η + 1)·u − T`` batches ahead of it, so it is trained at most η versions after the
current one. The same count projects the version a ready group is trained at
(``Collector.trained_at``).

``admission_batches`` = w (``CollectorConfig``) sets the window explicitly:
``untrained + running < (w − T)·B``. A window above ``(η + 1)·u`` trades staleness for
throughput: each group of window is one more group started and not yet trained, ≈ 1/(u·B)
of a version of mean staleness (Little's law); over η is handled by ``eta_mode`` and counted.
A window below it holds less work in flight (fewer groups interrupted by each weight update).

**Consumed is trained for admission.** A consumed batch's groups stay in ``batched/`` until
GC collects them, which waits for a commit when the trainer checkpoints
(``strawq.delivery.commits``). ``ConsumedGroups`` takes them out of *untrained*: otherwise a trainer
that commits once every N steps would free no room until the commit, and a GC interval
would hold every release back by up to that long.

The slot and backlog bounds always apply (with η = ∞ they are the only ones)::

    running < max_running                        (producers' slots + a small prefetch)
    ready + running < max_running + max_ready    (the ready backlog stays bounded)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from strawq.errors import CorruptRecord, NotFound
from strawq.tasks.states import Depths

if TYPE_CHECKING:
    from strawq.delivery.batches import BatchStore

__all__ = ["Admission", "ConsumedGroups", "Depths", "Progress", "admission", "progress"]


@dataclass(frozen=True)
class Progress:
    """Where the trainer stands against the current weight version (see the module text)."""

    #: T: batches delivered at the current version (or later): trained on it, update to come
    in_training: int = 0
    #: batches formed and neither delivered nor acked (refused ones left out)
    waiting: int = 0
    #: present batches whose groups no longer count as untrained
    consumed: frozenset[int] = frozenset()
    #: present batches in training (their groups are counted as ``in_training·B``)
    training: frozenset[int] = frozenset()

    @property
    def ahead(self) -> int:
        """Batches trained before a batch formed now: in training, then waiting."""
        return self.in_training + self.waiting


def progress(version: int, seqs: Iterable[int], acked: Collection[int],
             delivered: Mapping[int, int], refused: Collection[int] = (), *,
             batches_per_version: int = 1) -> Progress:
    """``Progress`` from the batches present (``seqs``), the acked ones, the delivery marks
    (batch -> version delivered at, retired batches included) and the refused ones.

    T is at most ``batches_per_version``: a trainer that trains more batches on one version
    than that (one that never updates the weights) has no update coming for the others,
    which are trained on the current version like any delivered batch."""
    present = set(seqs)
    training_all = {s for s, at in delivered.items() if at >= version}
    consumed = frozenset(s for s in present if (s in delivered and delivered[s] < version)
                         or (s not in delivered and s in acked))
    waiting = sum(1 for s in present if s not in delivered and s not in acked
                  and s not in refused)
    return Progress(min(len(training_all), batches_per_version), waiting, consumed,
                    frozenset(training_all & present))


@dataclass(frozen=True)
class Admission:
    capacity: int
    #: the tightest bound: "eta", "running" or "backlog"
    limited_by: str
    eta_room: int | None
    running_room: int
    backlog_room: int


def admission(depths: Depths, *, batch_groups: int, max_staleness: int | None,
              batches_per_version: int = 1, max_running: int, max_ready: int,
              window: float | None = None, in_training: int = 0) -> Admission:
    """The number of groups that may be released now (never negative); ``window``: the η
    bound in batches (``CollectorConfig.admission_batches``; None: ``(η + 1)·u``);
    ``in_training``: T, batches of the current version being trained (``Progress``), whose
    groups ``depths`` does not count."""
    running_room = max_running - depths.running
    backlog_room = max_running + max_ready - depths.ready - depths.running
    rooms = {"running": running_room, "backlog": backlog_room}
    eta_room: int | None = None
    if max_staleness is not None:
        if window is None:
            limit = (max_staleness + 1) * batch_groups * batches_per_version
        else:  # floor: a fractional window never rounds up into more room than configured
            limit = math.floor(window * batch_groups + 1e-9)
        eta_room = limit - in_training * batch_groups - depths.untrained - depths.running
        rooms["eta"] = eta_room
    limited_by = min(rooms, key=lambda k: rooms[k])
    capacity = max(rooms[limited_by], 0)
    return Admission(capacity, limited_by, eta_room, running_room, backlog_room)


class ConsumedGroups:
    """Groups of consumed batches GC has not collected yet (``strawq.delivery.batches.BatchStore``).

    ``untrained(depths, seqs, progress)`` is ``depths`` with the groups of consumed and
    in-training batches out of ``batched`` (in-training ones are counted as T·B by
    ``admission``). The counts are read from each manifest once (a manifest never changes)
    and forgotten when GC removes it. Pass the ``batch_seqs()`` listed *before* ``depths``:
    an ack that lands in between is then still counted as untrained (admission errs on the
    side of releasing too little).
    """

    def __init__(self, batches: BatchStore) -> None:
        self.batches = batches
        self._groups: dict[int, int] = {}

    def count(self, seqs: Iterable[int], consumed: Collection[int]) -> int:
        """Groups of the present batches in ``consumed``."""
        present = set(seqs)
        for seq in list(self._groups):
            if seq not in present:
                del self._groups[seq]
        total = 0
        for seq in present & set(consumed):
            if seq not in self._groups:
                try:
                    man = self.batches.read_manifest(seq)
                except (NotFound, CorruptRecord):
                    continue  # collected meanwhile, or GC's to quarantine: not counted
                self._groups[seq] = len(man.groups)
            total += self._groups[seq]
        return total

    def untrained(self, depths: Depths, seqs: Iterable[int], prog: Progress) -> Depths:
        gone = self.count(seqs, prog.consumed | prog.training)
        return replace(depths, batched=max(depths.batched - gone, 0))
