"""One rank of a multi-rank trainer watches ``batches/``; the others hear it over the process
group the trainer already has.

Each waiting rank of a W-rank trainer used to poll ``batches/`` itself (a stat every poll, a
listing of ``batches/`` and ``acked/`` and an end-of-run check once a second): at 10,000
GPUs that was ~90 % of the run's steady metadata load (``bench/scale.py --control-plane``).
With ``BatchReader(process_group=group)`` the group's rank 0 (the *watcher*) waits as a
single-rank reader does, and broadcasts what it found over ``group``
(``torch.distributed.broadcast_object_list``: the trainer's own group, CPU gloo or NCCL):

* ``("batch", seq, manifest)``: the next batch; every rank then loads its own shard of it
  (the data plane is unchanged: each rank reads its shard);
* ``("error", class, message)``: the watcher's ``next_batch`` ended with an exception before
  a batch — ``RunFinished``, ``BatchTimeout``, a fence's ``FencedOut`` or ``TrainerBusy``, a
  refused write — and every other rank raises the same (``WatcherFailed`` for an exception
  that is not strawq's own);
* ``("wait",)``: nothing yet, sent every ``beat_s`` seconds while the watcher waits, so no
  rank sits in one collective for longer than that however long ``timeout`` is (a
  collective has the process group's own timeout: 30 minutes by default for gloo, 10 for
  NCCL in many builds).

Every rank of the group must call ``next_batch`` as often as the others (a data-parallel
trainer does: every rank trains every step). If the watcher dies or hangs, the others wait
in the broadcast as they would in the trainer's next all-reduce, and fail as it would: at
the process group's timeout, or when the launcher (``torchrun``) tears the job down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from strawq.delivery.batches import Manifest
from strawq.errors import BatchTimeout, StrawqError

#: seconds between the watcher's "nothing yet" broadcasts while it waits
BEAT_S = 30.0


class WatcherFailed(StrawqError, RuntimeError):
    """The watching rank's ``next_batch`` failed with an exception that is not strawq's: this
    rank stops with it (the message names it)."""


class RankWatch:
    """The broadcast between the watching rank (the group's rank 0) and the others."""

    def __init__(self, group: Any, *, beat_s: float = BEAT_S) -> None:
        import torch.distributed as dist  # the trainer side: torch is there

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("BatchReader(process_group=...): torch.distributed is not "
                             "initialized; call init_process_group first, or pass no "
                             "process_group (every rank then watches batches/ itself)")
        if beat_s <= 0:
            raise ValueError(f"beat_s must be positive, got {beat_s}")
        self._dist = dist
        self.group = group
        self.size = dist.get_world_size(group)
        #: this process's rank in ``group``; rank 0 watches
        self.group_rank = dist.get_rank(group)
        if self.group_rank < 0:
            raise ValueError("BatchReader(process_group=...): this process is not a member "
                             "of that group")
        self.src = 0 if group is None or group is dist.group.WORLD \
            else dist.get_global_rank(group, 0)
        self.beat_s = beat_s
        #: events this rank sent (watcher) or heard (the others): batches, waits, errors
        self.events = 0

    @property
    def watcher(self) -> bool:
        """This rank watches ``batches/`` (the group's rank 0)."""
        return self.group_rank == 0

    def _broadcast(self, event: tuple[Any, ...] | None) -> tuple[Any, ...]:
        box: list[Any] = [event]
        self._dist.broadcast_object_list(box, src=self.src, group=self.group)
        self.events += 1
        got = box[0]
        assert isinstance(got, tuple)
        return got

    def watch(self, prepare: Callable[[], None], wait: Callable[[float], tuple[int, Manifest]],
              timeout_message: Callable[[float], str], timeout: float,
              clock: Callable[[], float]) -> tuple[int, Manifest]:
        """The watcher's wait: ``prepare()`` (rank 0's fence and liveness look), then
        ``wait(seconds)`` (``ManifestWait.next_manifest``) in slices of ``beat_s``; what
        comes of it is broadcast, then returned or raised."""
        deadline = clock() + timeout
        while True:
            left = part = 0.0
            try:
                prepare()
                left = max(deadline - clock(), 0.0)
                part = min(left, self.beat_s)
                got = wait(part)
            except BatchTimeout as exc:
                if part >= left:
                    final = BatchTimeout(timeout_message(timeout))
                    self._broadcast(("error", BatchTimeout, str(final)))
                    raise final from exc
                self._broadcast(("wait",))
                continue
            except BaseException as exc:
                self._broadcast(("error", _portable(exc), str(exc)))
                raise
            self._broadcast(("batch", got[0], got[1]))
            return got

    def hear(self) -> tuple[int, Manifest]:
        """Another rank's wait: the watcher's broadcasts until a batch (returned) or an
        error (raised here as the watcher raised it)."""
        while True:
            event = self._broadcast(None)
            if event[0] == "batch":
                return int(event[1]), event[2]
            if event[0] == "error":
                raise _rebuild(event[1], event[2])


def _portable(exc: BaseException) -> type[BaseException] | str:
    """The exception's class when another rank can rebuild it from its message, else its
    name."""
    cls = type(exc)
    return cls if issubclass(cls, StrawqError) else f"{cls.__module__}.{cls.__qualname__}"


def _rebuild(kind: type[BaseException] | str, message: str) -> BaseException:
    if isinstance(kind, type):
        try:
            return kind(message)
        except TypeError:  # a constructor that takes more than the message
            kind = f"{kind.__module__}.{kind.__qualname__}"
    return WatcherFailed(f"the watching rank (rank 0 of the reader's process group) failed in "
                         f"next_batch with {kind}: {message}; this rank stops with it")
