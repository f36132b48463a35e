"""Admission control (DESIGN §4): how many new prompt groups the feeder may release now.

The design states the staleness rule as ``accepted + running < (η + v + 1)·B`` with
*accepted* counted cumulatively since version 0 (as AReaL does): every group that ever
became ready, trained or not. With B groups trained per weight version, after v versions
``accepted_cumulative = v·B + untrained``, so the rule is exactly

    untrained + running < (η + 1)·B·u          (u = batches per version)

where *untrained* = ready + batched-not-yet-acked groups and *running* = pending + leased +
partial. The collector evaluates this form: it only needs what is on disk now, it survives
restarts, and a run resumed at version 37 on a fresh queue does not admit (η + 38)·B groups
in one burst (AReaL PR #1345). Why it bounds staleness: a group released now is trained
after the ``untrained + running`` groups ahead of it, i.e. at most η versions from now, and
its tokens carry versions ≥ the current one. Groups a filter drops leave both counts at
once, so their capacity is free again at once.

The slot and backlog bounds always apply (with η = ∞ they are the only ones)::

    running < max_running                        (producers' slots + a small prefetch)
    ready + running < max_running + max_ready    (the ready backlog stays bounded)
"""

from __future__ import annotations

from dataclasses import dataclass

from strawq.states import Depths

__all__ = ["Admission", "Depths", "admission"]


@dataclass(frozen=True)
class Admission:
    capacity: int
    #: the tightest bound: "eta", "running" or "backlog"
    limited_by: str
    eta_room: int | None
    running_room: int
    backlog_room: int


def admission(depths: Depths, *, batch_groups: int, max_staleness: int | None,
              batches_per_version: int = 1, max_running: int, max_ready: int) -> Admission:
    """The number of groups that may be released now (never negative)."""
    running_room = max_running - depths.running
    backlog_room = max_running + max_ready - depths.ready - depths.running
    rooms = {"running": running_room, "backlog": backlog_room}
    eta_room: int | None = None
    if max_staleness is not None:
        limit = (max_staleness + 1) * batch_groups * batches_per_version
        eta_room = limit - depths.untrained - depths.running
        rooms["eta"] = eta_room
    limited_by = min(rooms, key=lambda k: rooms[k])
    capacity = max(rooms[limited_by], 0)
    return Admission(capacity, limited_by, eta_room, running_room, backlog_room)
