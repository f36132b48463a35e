"""The generate plugin: the one code path that turns a sample into a trajectory.

A generate plugin owns one sample's trajectory. The producer calls it once per sample task
(after the sample holds a trajectory slot) with a :class:`GenerateContext`; the plugin calls
the engine turn by turn through it, appends non-generated tokens, calls tools, and ends the
sample. Single-turn generation is the built-in :func:`single_turn`, the default.

Contract (``ProducerConfig.plugins.generate``, a dotted path resolved and checked at
start-up; with ``generate_args`` it names a factory called once with them)::

    async def generate(ctx: GenerateContext) -> None

    turn = await ctx.generate()          # one turn from prompt + response so far
    ctx.append(ids, kind="tool")         # tokens the model did not generate: loss mask 0
    out = await ctx.call_tool(name, args, fn)   # fn(args, key) -> JSON-able, sync or async
    ctx.finish("completed" | "truncated")       # end the sample (or ctx.fail(reason))

Rules the plugin must keep:

1. **Let** :class:`Halted` **propagate.** Any ``ctx`` call raises it when the producer stops
   the sample (weight update, stop, lease lost, engine fault); the trajectory so far is
   persisted as a partial and the plugin runs again on resume.
2. **Be deterministic given the trajectory.** On resume the plugin runs from the start and
   the context *replays* the record: ``generate`` returns the recorded turns, ``call_tool``
   the recorded results (the tool is not executed again), ``append`` checks the tokens are
   the recorded ones (else :class:`~strawq.producers.trajectory.TrajectoryError`). Keep
   environment state in the trajectory (tool results), not in the plugin.
3. **Tools are at-least-once; make them idempotent by key.** A call whose result was
   persisted never runs again. A call in flight when the producer crashed or was stopped
   runs again with the *same* idempotency key (``key`` argument) when the trajectory
   resumes from a saved record, so a tool with side effects deduplicates by it; a
   trajectory begun afresh (its prefix regenerated, or nothing saved yet) is a new episode
   with new keys (``Trajectory.gen``). Records are saved at every turn boundary (turn
   checkpoints, ``strawq.turns``; ``tools.checkpoint_every_*``); ``call_tool(...,
   idempotent=False, reconcile=hook)`` journals the call durably before it runs and asks
   ``hook`` on resume instead of re-running it; ``ctx.environment(env)`` snapshots and
   restores the sample's environment with every record.

Budgets (exact across turns): ``max_new_tokens`` bounds the whole response (generated and
appended tokens); each turn gets ``max_new_tokens - len(response)`` (and the context-length
clamp); an ``append`` that does not fit either bound (``max_new_tokens``, or prompt +
response ≤ ``context_length − 1``) is refused and ends the sample ``truncated``;
``tools.max_turns`` (0: unlimited) ends it ``truncated`` before the turn past the limit.
Ending the sample (``finish`` / ``fail``) before the replay has reached the end of the
record raises :class:`~strawq.producers.trajectory.TrajectoryError`. Tool calls time out
after ``tools.timeout_s``, are retried ``tools.retries`` times, then ``tools.on_failure``
decides:
``fail_sample`` (recorded as ``failed``, reward None, loss mask 0 — never trained as a
finished trajectory), ``drop_group`` (the group is dropped as ``tool_error``), or
``restart`` (the sample starts again in a fresh environment: new epoch, new keys).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from strawq.errors import ConfigError, LeaseLost, StorageFull, StrawqError

from strawq.producers.plugins import is_async, resolve_with_args
from strawq.producers.sample import (LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, VERSION_DTYPE,
                                     SampleStatus)
from strawq.producers.trajectory import Trajectory, TrajectoryError, idempotency_key

if TYPE_CHECKING:
    from strawq.producers.group import GroupRun
    from strawq.producers.producer_config import ToolsConfig
    from strawq.producers.sample import Sample
    from strawq.producers.turn_saver import TurnSaver

log = logging.getLogger(__name__)

GenerateFn = Callable[["GenerateContext"], Awaitable[None]]
ToolFn = Callable[[Any, str], Any]
DEFAULT_GENERATE = "strawq.producers.generate.single_turn"
#: how often a running tool call looks at the producer's halt (a pause, a stop): a call
#: running then is left to finish on its own (``GroupRunner.detached``)
TOOL_HALT_POLL_S = 0.02
#: the longest wait between tries of a tool-call journal entry that met a full disk
JOURNAL_FULL_RETRY_MAX_S = 2.0


class _NotApplied:
    def __repr__(self) -> str:
        return "NOT_APPLIED"


#: what a ``reconcile`` hook returns when the interrupted call took no effect (it runs now)
NOT_APPLIED: Any = _NotApplied()


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


class _Ended(Exception):
    """Internal: the sample ended (budget) inside a context call."""


@dataclass(frozen=True)
class Turn:
    """One generated turn: its tokens, how it ended (``stop`` / ``length``), and whether it
    was replayed from the record."""

    token_ids: list[int]
    finish: str
    text: str = ""
    replayed: bool = False


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


class GenerateContext:
    """What a generate plugin sees of the producer for one sample."""

    def __init__(self, host: SampleHost, index: int, version: int) -> None:
        self._host = host
        run = host.run
        if run is None:
            raise TrajectoryError("a generate context needs a built group")
        self._run: GroupRun = run
        self.index = index
        self._version = version
        s = run.samples[index]
        self.trajectory: Trajectory = run.trajectories[index]
        self.trajectory.check(s.response_length, s.loss_mask)
        if self.trajectory.gen is None:  # the generation its tool calls' keys name
            lease = run.lease
            self.trajectory.gen = lease.name.resume if lease.has_partial else lease.gen
        self._pos = 0  # replay cursor into trajectory.events
        self._turn_text = ""
        self._live = False  # the replay is over and the environment restored
        self._boundary = False  # a turn boundary passed since the last live operation

    # -- what the plugin reads -----------------------------------------------------------
    @property
    def sample(self) -> Sample:
        return self._run.samples[self.index]

    @property
    def task(self) -> dict[str, Any]:
        return self._run.lease.task

    @property
    def lease_generation(self) -> int:
        """The generation of the lease this context runs under: a *fencing token* for
        tools with effects outside the producer. A holder whose lease expired (a stopped
        host, a partition) may run on until its next write finds it fenced; a tool that
        keeps the highest generation it has seen per task and refuses a lower one never
        runs a call for a lease that a newer holder took over (``strawq.demo.agentic_kv``
        with ``tool_url`` sends it; docs/agentic.md, "Tools")."""
        return int(self._run.lease.gen)

    @property
    def task_id(self) -> str:
        return str(self._run.task_id)

    @property
    def replaying(self) -> bool:
        return self._pos < len(self.trajectory.events)

    @property
    def remaining_budget(self) -> int:
        return self.sample.remaining_budget(self._host.context_length)

    def token_ids(self) -> list[int]:
        """Prompt + response so far: the next turn's input."""
        return self.sample.resume_input_ids()

    def environment(self, env: Environment) -> None:
        """Register this sample's environment: its ``snapshot()`` is saved with every
        partial record (turn checkpoints and yields), and when the trajectory resumes, the
        context calls ``restore(state)`` the moment the replay ends — so the first live
        operation sees the world as it was at the saved point. Without a snapshot of that
        point, ``rebuild(tool_events)`` when the environment has one, else the sample fails
        (its state cannot be brought back). Register it before the first operation."""
        self._run.envs[self.index] = env

    # -- turn boundaries and the end of the replay -------------------------------------
    async def _go_live(self) -> None:
        """Before live work: bring the environment back once (the replay just ended), and
        save the turn checkpoint a passed boundary asks for."""
        if not self._live:
            self._live = True
            self._restore_env()
        if self._boundary:
            self._boundary = False
            await self._save()

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

    async def _save(self, *, force: bool = False) -> bool:
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

    async def _ended(self) -> None:
        """The sample ended after a live boundary while siblings still run: save it (its
        last turn would else be lost to a crash before the group is handed back)."""
        if self._boundary and not self._run.all_final:
            self._boundary = False
            await self._save()

    # -- operations ----------------------------------------------------------------------
    def _next_recorded(self, op: str) -> dict[str, Any] | None:
        if not self.replaying:
            return None
        e = self.trajectory.events[self._pos]
        if e["op"] != op:
            raise TrajectoryError(f"sample {self.sample.uid}: replay expected a {e['op']!r} "
                                  f"event at step {self._pos}, the plugin did {op!r}; a "
                                  "generate plugin must be deterministic given its trajectory")
        return e

    async def generate(self) -> Turn:
        """One turn: generate from prompt + response until the engine stops (stop token or
        budget). Raises :class:`Halted` when the producer stops the sample."""
        s = self.sample
        e = self._next_recorded("gen")
        if e is not None and e["end"] is not None:
            self._pos += 1
            return Turn([int(t) for t in s.response_ids[e["start"]:e["end"]]], str(e["finish"]),
                        replayed=True)
        if e is None:
            limit = self._host.tools.max_turns
            if limit and self.trajectory.turns >= limit:
                self._end(SampleStatus.TRUNCATED, {"type": "length", "limit": "max_turns"})
        await self._go_live()
        if e is None:
            e = {"op": "gen", "start": s.response_length, "end": None, "finish": None}
            self.trajectory.events.append(e)
        self._pos = len(self.trajectory.events)
        cap = self._host.tools.max_turn_tokens
        s.turn_limit = int(e["start"]) + cap if cap else None
        try:
            finish = await self._host.generate_turn(self.index)
        finally:
            s.turn_limit = None
        if s.status is SampleStatus.COMPLETED or s.status is SampleStatus.TRUNCATED:
            s.status = SampleStatus.PENDING  # the turn ended; the plugin ends the sample
        e["end"], e["finish"] = s.response_length, finish
        self._boundary = True
        return Turn([int(t) for t in s.response_ids[e["start"]:e["end"]]], finish)

    def append(self, token_ids: Sequence[int], *, kind: str = "tool") -> None:
        """Append tokens the model did not generate (loss mask 0, log-prob 0, the version of
        the last generated token).

        An append that does not fit is refused, never cut (appended tokens are exactly what
        the environment returned): the sample ends ``truncated`` with ``finish_reason``
        ``{"type": "length", "limit": "append"}`` past ``max_new_tokens``, or ``"limit":
        "context_length"`` when prompt + response + the tokens would pass
        ``context_length − 1`` (the longest sequence the engine serves; docs/design.md,
        invariant 4), as a turn does when its budget is spent."""
        s = self.sample
        ids = np.asarray([int(t) for t in token_ids], dtype=TOKEN_DTYPE)
        e = self._next_recorded("append")
        if e is not None:
            if not np.array_equal(s.response_ids[e["start"]:e["end"]], ids):
                raise TrajectoryError(f"sample {s.uid}: replayed append differs from the "
                                      "record; a generate plugin must be deterministic")
            self._pos += 1
            return
        if not self._live:  # the first live operation: the environment comes back first
            self._live = True
            self._restore_env()
        if len(ids) > self.remaining_budget:
            over = s.response_length + len(ids) > s.params.max_new_tokens
            self._end(SampleStatus.TRUNCATED, {
                "type": "length", "limit": "append" if over else "context_length",
                "tokens": len(ids)})
        version = int(s.versions[-1]) if len(s.versions) else self._version
        start = s.response_length
        s.response_ids = np.concatenate([s.response_ids, ids])
        s.logprobs = np.concatenate([s.logprobs, np.zeros(len(ids), LOGPROB_DTYPE)])
        s.versions = np.concatenate([s.versions, np.full(len(ids), version, VERSION_DTYPE)])
        s.loss_mask = np.concatenate([s.loss_mask, np.zeros(len(ids), MASK_DTYPE)])
        s.pad_extras(len(ids))
        s.check()
        self.trajectory.events.append({"op": "append", "start": start,
                                       "end": s.response_length, "kind": str(kind)})
        self._pos = len(self.trajectory.events)

    async def call_tool(self, name: str, args: Any, fn: ToolFn, *, idempotent: bool = True,
                        reconcile: ToolFn | None = None) -> Any:
        """Call ``fn(args, key)`` once for this point of the trajectory (replayed calls
        return the recorded result). Timeouts and errors are retried, then the failure
        policy applies (:class:`SampleFailed`).

        The call is journalled: the trajectory's ``inflight`` entry (key, name, args) is
        set before it runs and replaced by its ``tool`` event when it returns. A call that
        was in flight when the trajectory was interrupted runs again with the same key —
        unless ``idempotent=False``: then its journal entry is saved durably before it
        runs, and on resume ``reconcile(args, key)`` (sync or async) says what happened —
        the call's result if it took effect, :data:`NOT_APPLIED` if it did not (it runs
        now); without ``reconcile`` the sample fails with the reason recorded. A call still
        running when the producer pauses is left to finish (the pause is acknowledged
        without waiting for it); its result is applied when the trajectory resumes on this
        producer (elsewhere the call counts as interrupted). A call on a sample with a
        registered environment is waited for instead: its effect belongs in the snapshot."""
        s = self.sample
        e = self._next_recorded("tool")
        if e is not None:
            if e["name"] != name:
                raise TrajectoryError(f"sample {s.uid}: replayed tool call {name!r} differs "
                                      f"from the recorded {e['name']!r}")
            self._pos += 1
            self._host.bump("tool_calls_replayed")
            return e["result"]
        await self._go_live()
        ordinal = len(self.trajectory.tool_calls())
        key = idempotency_key(self._run.task_id, self.index, self.trajectory.epoch, ordinal,
                              name, args, s.response_ids.tolist(), gen=self.trajectory.gen)
        journal = self.trajectory.inflight
        interrupted = journal is not None and journal.get("key") == key
        t0, started = time.monotonic(), time.time()
        detached = self._host.take_detached(key)
        if detached is not None and not detached.cancelled():
            # left running at a pause: its outcome, not a second run
            result, attempt = await detached
            return self._record_tool(key, name, args, result, attempt, t0, started)
        if interrupted and not idempotent:
            if reconcile is None:
                raise SampleFailed(
                    f"tool {name!r} (not idempotent, key {key}) was in flight when the "
                    "trajectory was interrupted and has no reconcile hook: whether it took "
                    "effect is unknown, so it is not run again", policy="fail_sample")
            try:
                outcome = reconcile(args, key)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
            except Exception as exc:  # noqa: BLE001 - the hook's failure is the sample's
                raise SampleFailed(f"tool {name!r}: reconcile of the interrupted call {key} "
                                   f"failed: {type(exc).__name__}: {exc}"[:500]) from None
            if outcome is not NOT_APPLIED:
                self._host.bump("tool_calls_reconciled")
                return self._record_tool(key, name, args, outcome, 0, t0, started,
                                         reconciled=True)
        elif interrupted:
            self._host.bump("tool_calls_rerun")
        self.trajectory.inflight = {"key": key, "name": name, "args": args,
                                    "idempotent": bool(idempotent), "started": started}
        if not idempotent:  # the journal entry is durable before the call can take effect
            await self._save(force=True)
        self._host.check_halted()
        task = asyncio.ensure_future(self._attempts(name, args, fn, key))
        while True:
            done, _ = await asyncio.wait({task}, timeout=TOOL_HALT_POLL_S)
            if done:
                break
            if self._host.abandoned:
                task.cancel()
                raise Halted()
            if self._host.halted() and self.index not in self._run.envs:
                # it goes on; the resumed trajectory applies its outcome (a call on a
                # registered environment is waited for: its effect belongs in the snapshot)
                self._host.detach(key, task)
                self._host.bump("tool_calls_detached")
                raise Halted()
        result, attempt = task.result()
        return self._record_tool(key, name, args, result, attempt, t0, started)

    async def _attempts(self, name: str, args: Any, fn: ToolFn, key: str) -> tuple[Any, int]:
        """Run the tool until it succeeds or its tries are spent (``SampleFailed``)."""
        tools = self._host.tools
        error = ""
        for attempt in range(1, tools.retries + 2):
            try:
                if is_async(fn):
                    result = await asyncio.wait_for(fn(args, key), tools.timeout_s)
                else:
                    result = await asyncio.wait_for(self._host.offload(fn, args, key),
                                                    tools.timeout_s)
                    if inspect.isawaitable(result):
                        result = await asyncio.wait_for(result, tools.timeout_s)
            except TimeoutError:
                error = f"tool {name!r} timed out after {tools.timeout_s}s"
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the sample's
                error = f"tool {name!r} failed: {type(exc).__name__}: {exc}"[:500]
            else:
                return result, attempt
            self._host.bump("tool_errors")
            log.info("sample %s: %s (attempt %d)", self.sample.uid, error, attempt)
        raise SampleFailed(error, policy=tools.on_failure)

    def _record_tool(self, key: str, name: str, args: Any, result: Any, attempt: int,
                     t0: float, started: float, *, reconciled: bool = False) -> Any:
        seconds = time.monotonic() - t0
        if not reconciled:
            self._host.bump("tool_calls")
            self._host.hop("tool", seconds)
        ev = {"op": "tool", "key": key, "name": name, "args": args, "result": result,
              "attempts": attempt, "seconds": seconds, "started": started}
        if reconciled:
            ev["reconciled"] = True
        self.trajectory.events.append(ev)
        self.trajectory.inflight = None
        self._pos = len(self.trajectory.events)
        self._boundary = True
        return result

    def _refuse_end_in_replay(self, what: str) -> None:
        """Ending the sample before the replay reached the end of the record means the
        plugin is not deterministic given its trajectory: an aborted turn (the record's
        open ``gen``) or recorded events would be trained as a trajectory they are not."""
        if self.replaying:
            e = self.trajectory.events[self._pos]
            raise TrajectoryError(
                f"sample {self.sample.uid}: {what} during the replay, at step {self._pos} of "
                f"{len(self.trajectory.events)} recorded (next: a {e['op']!r} event"
                f"{', an aborted turn' if e['op'] == 'gen' and e['end'] is None else ''}); a "
                "generate plugin must replay its recorded operations before it ends the "
                "sample")

    def finish(self, status: str = "completed", reason: Mapping[str, Any] | None = None) -> None:
        """End the sample: ``completed`` or ``truncated``. Raises
        :class:`~strawq.producers.trajectory.TrajectoryError` during the replay (the sample
        fails: an aborted turn is never trained as complete)."""
        self._refuse_end_in_replay(f"finish({status!r})")
        st = SampleStatus(status)
        if not st.is_final:
            raise TrajectoryError(f"finish status must be completed or truncated, got {status!r}")
        s = self.sample
        s.status = st
        s.finish_reason = dict(reason) if reason is not None else (
            s.finish_reason or {"type": "stop" if st is SampleStatus.COMPLETED else "length"})

    def fail(self, reason: str) -> None:
        """End the sample as failed (environment or infrastructure): never trained. During
        the replay it raises :class:`~strawq.producers.trajectory.TrajectoryError` (the
        sample fails too, with that message)."""
        self._refuse_end_in_replay(f"fail({reason!r})")
        raise SampleFailed(reason, policy="fail_sample")

    def _end(self, status: SampleStatus, reason: dict[str, Any]) -> None:
        s = self.sample
        s.status = status
        s.finish_reason = dict(reason)
        raise _Ended()


async def single_turn(ctx: GenerateContext) -> None:
    """The built-in plugin: one turn, ended by the engine's finish reason."""
    turn = await ctx.generate()
    ctx.finish("completed" if turn.finish == "stop" else "truncated")


def load_generate(path: str | None, args: Mapping[str, Any] | None = None) -> GenerateFn:
    """The generate plugin at ``path`` (``async def fn(ctx)``); with ``args`` the factory at
    ``path`` called with them. Checked at start-up."""
    path = path or DEFAULT_GENERATE
    fn: GenerateFn = resolve_with_args(path, args, what="generate plugin", arity=1,
                                       args_key="generate_args", takes="(ctx)")
    if not is_async(fn):
        raise ConfigError(f"generate plugin {path} must be an async function "
                          "(async def generate(ctx) -> None)")
    return fn


async def run_plugin(generate_fn: GenerateFn, host: SampleHost, i: int, version: int
                     ) -> None:
    """Run the generate plugin on sample ``i`` of ``host``'s group until it ends or is
    halted. A failure (tool, plugin bug) ends the sample as failed, or drops the group, or
    restarts the sample in a fresh environment, per ``tools.on_failure``; :class:`Halted`
    propagates."""
    run = host.run
    if run is None:
        return
    restarts = 0
    while True:
        ctx = GenerateContext(host, i, version)
        s = run.samples[i]
        try:
            await generate_fn(ctx)
            if not s.is_final:
                raise SampleFailed("the generate plugin returned without ending the sample "
                                   "(call ctx.finish)")
            await ctx._ended()
            return
        except _Ended:
            await ctx._ended()
            return
        except SampleFailed as exc:
            if exc.policy == "restart" and restarts < host.tools.retries:
                restarts += 1
                run.restart_sample(i)
                log.info("sample %s: restarting in a fresh environment (%s)", s.uid, exc)
                continue
            if exc.policy == "drop_group":
                host.drop_group("tool_error", str(exc), keep=i)
                raise Halted() from None
            run.fail_sample(i, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a plugin bug fails its sample, not the loop
            log.exception("sample %s: the generate plugin raised", s.uid)
            run.fail_sample(i, f"generate plugin raised {type(exc).__name__}: {exc}"[:500])
            return


__all__ = ["DEFAULT_GENERATE", "NOT_APPLIED", "Environment", "GenerateContext", "GenerateFn",
           "Halted", "SampleFailed", "SampleHost", "Turn", "load_generate", "run_plugin",
           "single_turn"]
