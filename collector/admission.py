"""Admission control: how many new prompt groups the feeder may release now.

The staleness rule (docs/design.md, "Sizing") in the form the collector evaluates::

    untrained + running < (η + 1)·B·u          (u = batches per version)

where *untrained* = ready + batched-not-yet-acked groups and *running* = pending + leased +
partial. Counted cumulatively since version 0 (every group that ever became ready, trained
or not, as AReaL counts it), ``accepted_cumulative = v·B·u + untrained`` after v versions,
and the rule reads ``accepted + running < (η + v + 1)·B·u``. This form needs only what is on
disk now: it survives restarts, and a run resumed at version 37 on a fresh queue does not
admit (η + 38)·B groups in one burst (AReaL PR #1345). Why it bounds staleness: a group
released now is trained after the ``untrained + running`` groups ahead of it, i.e. at most
η versions from now, and its tokens carry versions ≥ the current one. Groups a filter drops
leave both counts at once, so their capacity is free again at once.

``admission_batches`` = w (``CollectorConfig``) sets the window explicitly:
``untrained + running < w·B``. The default form counts a version's batches as untrained
until the trainer acks them, which it does after the version's update. A trainer that acks
each batch as soon as it has trained it (``strawq.demo.schedule``'s ``flow``) frees that room
during the version instead, and for it ``w = η·u + 1`` is the same guarantee: a group
released after j < u of the current version's batches were acked has fewer than w·B groups
ahead of it, and (u − j)·B + η·u·B ≥ (η·u + 1)·B of them are trained within η versions.
(Between the version's last ack and its update the producers are being paused; a group
claimed in that instant can be one version over.) A window between η·u + 1 and (η + 1)·u
trades staleness for throughput: each group of window is one more group started and not
yet trained, ≈ 1/(u·B) of a version of mean staleness (Little's law); over η is handled by
``eta_mode`` and counted.

**Acked is trained for admission.** A batch the trainer acked is consumed; its groups stay in
``batched/`` until GC collects them, which waits for a commit when the trainer checkpoints
(``strawq.commits``). ``AckedGroups`` takes them out of *untrained*: otherwise a trainer that
acks every micro-batch but commits once a step would free no room until the commit, and a GC
interval would hold every release back by up to that long.

The slot and backlog bounds always apply (with η = ∞ they are the only ones)::

    running < max_running                        (producers' slots + a small prefetch)
    ready + running < max_running + max_ready    (the ready backlog stays bounded)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from strawq.errors import CorruptRecord, NotFound
from strawq.states import Depths

if TYPE_CHECKING:
    from strawq.batches import BatchStore

__all__ = ["AckedGroups", "Admission", "Depths", "admission"]


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
              window: float | None = None) -> Admission:
    """The number of groups that may be released now (never negative); ``window``: the η
    bound in batches (``CollectorConfig.admission_batches``; None: ``(η + 1)·u``)."""
    running_room = max_running - depths.running
    backlog_room = max_running + max_ready - depths.ready - depths.running
    rooms = {"running": running_room, "backlog": backlog_room}
    eta_room: int | None = None
    if max_staleness is not None:
        if window is None:
            limit = (max_staleness + 1) * batch_groups * batches_per_version
        else:  # floor: a fractional window never rounds up into more room than configured
            limit = math.floor(window * batch_groups + 1e-9)
        eta_room = limit - depths.untrained - depths.running
        rooms["eta"] = eta_room
    limited_by = min(rooms, key=lambda k: rooms[k])
    capacity = max(rooms[limited_by], 0)
    return Admission(capacity, limited_by, eta_room, running_room, backlog_room)


class AckedGroups:
    """Groups of acked batches GC has not collected yet (``strawq.batches.BatchStore``).

    ``untrained(depths, seqs, acked)`` is ``depths`` with them out of ``batched``. The counts
    are read from each manifest once (a manifest never changes) and forgotten when GC removes
    it. Pass the ``batch_seqs()`` listed *before* ``depths``: an ack that lands in between is
    then still counted as untrained (admission errs on the side of releasing too little).
    """

    def __init__(self, batches: BatchStore) -> None:
        self.batches = batches
        self._groups: dict[int, int] = {}

    def count(self, seqs: Iterable[int], acked: Collection[int]) -> int:
        present = set(seqs)
        for seq in list(self._groups):
            if seq not in present:
                del self._groups[seq]
        total = 0
        for seq in present & set(acked):
            if seq not in self._groups:
                try:
                    man = self.batches.read_manifest(seq)
                except (NotFound, CorruptRecord):
                    continue  # collected meanwhile, or GC's to quarantine: not counted
                self._groups[seq] = len(man.groups)
            total += self._groups[seq]
        return total

    def untrained(self, depths: Depths, seqs: Iterable[int], acked: Collection[int]) -> Depths:
        return replace(depths, batched=max(depths.batched - self.count(seqs, acked), 0))
