"""The generate context's record surface: the sample's trajectory replayed, then extended.

A ``TrajectoryReplay`` is the cursor of one sample's generate context over its recorded
trajectory (``Trajectory.events``): while the plugin's operations meet recorded events they
are replayed (``next_recorded``); the first live operation brings the sample's
environment back (its snapshot at the resumed point, or ``rebuild(tool_events)``), and a
turn boundary passed since the last live operation saves a turn checkpoint first
(``strawq.producers.turn_saver``, fenced: a newer holder of the task stops the group).

Also here, shared by the context's parts (``strawq.producers.generate`` and its tool calls,
``strawq.producers.generate_tools``): what the context reaches of the producer
(:class:`SampleHost`), the plugin's signals (:class:`Halted`, :class:`SampleFailed`) and
the environment a plugin registers (:class:`Environment`). ``strawq.producers.generate``
re-exports them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from strawq.errors import LeaseLost, StorageFull, StrawqError

from strawq.producers.trajectory import Trajectory, TrajectoryError

if TYPE_CHECKING:
    from strawq.producers.group import GroupRun
    from strawq.producers.producer_config import ToolsConfig
    from strawq.producers.sample import Sample
    from strawq.producers.turn_saver import TurnSaver

log = logging.getLogger(__name__)

#: the longest wait between tries of a tool-call journal entry that met a full disk
JOURNAL_FULL_RETRY_MAX_S = 2.0


class Environment(Protocol):
    """What ``GenerateContext.environment`` takes: an environment whose state the producer
    saves with every partial record and restores when the trajectory resumes. ``rebuild``
    (optional) rebuilds the state from the trajectory's tool calls instead, when no
    snapshot of the resumed point exists."""

    def snapshot(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


class Halted(BaseException):  # noqa: N818 - a control-flow signal like CancelledError
    """The producer stopped this sample; let it propagate (a ``BaseException`` so that a
    plugin's ``except Exception`` does not swallow it)."""


class SampleFailed(StrawqError, RuntimeError):
    """The sample cannot finish (tool or environment failure after its retries)."""

    def __init__(self, message: str, *, policy: str = "fail_sample") -> None:
        super().__init__(message)
        self.policy = policy


class Ended(Exception):  # noqa: N818 - a control-flow signal
    """Internal: the sample ended (budget) inside a context call."""


class SampleHost(Protocol):
    """What a generate context reaches of the producer, for one group: the engine's turns,
    the group's halt, its turn checkpoints, the tools' settings and thread pool, and the
    producer's counters — and nothing else of the runner (``GroupRunner.host``)."""

    @property
    def run(self) -> GroupRun | None: ...

    @property
    def tools(self) -> ToolsConfig: ...

    @property
    def context_length(self) -> int | None: ...

    @property
    def turns(self) -> TurnSaver | None: ...

    @property
    def abandoned(self) -> bool: ...

    def halted(self) -> bool: ...

    def check_halted(self) -> None:
        """Raise :class:`Halted` when the group's samples must stop."""

    async def generate_turn(self, i: int) -> str:
        """Generate sample ``i`` until the engine ends the turn (``stop`` / ``length``)."""

    def lose_lease(self, keep: int) -> None:
        """A newer holder fenced this one: stop everything, persist nothing."""

    def drop_group(self, reason: str, message: str, keep: int) -> None:
        """Drop the whole group with ``reason`` once its samples stopped."""

    def take_detached(self, key: str) -> asyncio.Future[Any] | None:
        """The tool call with idempotency ``key`` left running at a pause, if any."""

    def detach(self, key: str, task: asyncio.Future[Any]) -> None:
        """Leave a tool call running past its sample's halt."""

    def offload(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Run a blocking ``fn(*args)`` off the event loop."""

    def bump(self, counter: str, n: int = 1) -> None: ...

    def hop(self, name: str, seconds: float) -> None: ...


class TrajectoryReplay:
    """One sample's replay cursor over its recorded trajectory, its environment restore
    and its turn-checkpoint saves (see the module's docstring)."""

    def __init__(self, host: SampleHost, run: GroupRun, index: int, version: int) -> None:
        self._host = host
        self._run = run
        self.index = index
        self._version = version
        s = run.samples[index]
        self.trajectory: Trajectory = run.trajectories[index]
        self.trajectory.check(s.response_length, s.loss_mask)
        if self.trajectory.gen is None:  # the generation its tool calls' keys name
            lease = run.lease
            self.trajectory.gen = lease.name.resume if lease.has_partial else lease.gen
        self.pos = 0  # replay cursor into trajectory.events
        self._live = False  # the replay is over and the environment restored
        self._boundary = False  # a turn boundary passed since the last live operation

    @property
    def sample(self) -> Sample:
        return self._run.samples[self.index]

    @property
    def replaying(self) -> bool:
        return self.pos < len(self.trajectory.events)

    def next_recorded(self, op: str) -> dict[str, Any] | None:
        """The recorded event the plugin's ``op`` replays (None once the replay is over);
        a different operation there is a :class:`TrajectoryError`."""
        if not self.replaying:
            return None
        e = self.trajectory.events[self.pos]
        if e["op"] != op:
            raise TrajectoryError(f"sample {self.sample.uid}: replay expected a {e['op']!r} "
                                  f"event at step {self.pos}, the plugin did {op!r}; a "
                                  "generate plugin must be deterministic given its trajectory")
        return e

    def record(self, event: dict[str, Any] | None = None, *, boundary: bool = False) -> None:
        """A live event appended (``event``), the cursor at the record's end; ``boundary``:
        a turn boundary passed (the next live operation saves a turn checkpoint first)."""
        if event is not None:
            self.trajectory.events.append(event)
        self.pos = len(self.trajectory.events)
        if boundary:
            self._boundary = True

    def boundary(self) -> None:
        """A turn boundary passed (a turn ended)."""
        self._boundary = True

    def ensure_live(self) -> None:
        """The first live operation: the environment comes back first."""
        if not self._live:
            self._live = True
            self._restore_env()

    async def go_live(self) -> None:
        """Before live work: bring the environment back once (the replay just ended), and
        save the turn checkpoint a passed boundary asks for."""
        self.ensure_live()
        if self._boundary:
            self._boundary = False
            await self.save()

    def _restore_env(self) -> None:
        env = self._run.envs.get(self.index)
        t = self.trajectory
        if env is None or not t.events:
            return
        snap = t.env
        if snap is not None and int(snap.get("at", -1)) == len(t.events):
            env.restore(snap.get("state"))
            return
        rebuild = getattr(env, "rebuild", None)
        if callable(rebuild):
            rebuild([dict(e) for e in t.tool_calls()])
            return
        raise SampleFailed(
            f"sample {self.sample.uid}: its environment cannot be restored: the record has "
            f"{len(t.events)} events but "
            + ("no environment snapshot" if snap is None else
               f"a snapshot of event {snap.get('at')}")
            + " and the environment has no rebuild(tool_events)", policy="fail_sample")

    async def save(self, *, force: bool = False) -> bool:
        """A turn checkpoint (``strawq.producers.turn_saver``); fenced: a newer holder of
        the task stops this group without persisting anything."""
        saver = self._host.turns
        if saver is None:
            return False
        try:
            try:
                return await saver.boundary(self._run, self._version, force=force)
            except StorageFull as exc:
                if not force:
                    raise
                return await self._save_when_space(saver, exc)
        except LeaseLost as exc:
            log.warning("task %s: %s", self._run.task_id, exc)
            self._host.lose_lease(keep=self.index)
            raise Halted() from None
        except Exception as exc:  # noqa: BLE001 - storage trouble: a missed checkpoint
            if force:
                raise SampleFailed(f"the tool-call journal could not be saved: {exc}"
                                   [:500]) from None
            log.warning("task %s: turn checkpoint failed: %s", self._run.task_id, exc)
            return False

    async def _save_when_space(self, saver: Any, exc: StorageFull) -> bool:
        """A journal entry that must be durable before its tool call met a full disk: the
        call waits (backing off up to ``JOURNAL_FULL_RETRY_MAX_S``) until the entry is saved,
        rather than failing the sample. A producer that gives its leases up meanwhile
        cancels the wait with the sample."""
        log.error("task %s: the tool-call journal cannot be saved (%s); the call waits "
                  "until space returns", self._run.task_id, exc.strerror or exc)
        wait = 0.05
        while True:
            await asyncio.sleep(wait)
            wait = min(2 * wait, JOURNAL_FULL_RETRY_MAX_S)
            self._host.check_halted()
            try:
                saved: bool = await saver.boundary(self._run, self._version, force=True)
            except StorageFull:
                continue
            log.info("task %s: the tool-call journal is saved; the call goes on",
                     self._run.task_id)
            return saved

    async def ended(self) -> None:
        """The sample ended after a live boundary while siblings still run: save it (its
        last turn would else be lost to a crash before the group is handed back)."""
        if self._boundary and not self._run.all_final:
            self._boundary = False
            await self.save()

    def refuse_end_in_replay(self, what: str) -> None:
        """Ending the sample before the replay reached the end of the record means the
        plugin is not deterministic given its trajectory: an aborted turn (the record's
        open ``gen``) or recorded events would be trained as a trajectory they are not."""
        if self.replaying:
            e = self.trajectory.events[self.pos]
            raise TrajectoryError(
                f"sample {self.sample.uid}: {what} during the replay, at step {self.pos} of "
                f"{len(self.trajectory.events)} recorded (next: a {e['op']!r} event"
                f"{', an aborted turn' if e['op'] == 'gen' and e['end'] is None else ''}); a "
                "generate plugin must replay its recorded operations before it ends the "
                "sample")
