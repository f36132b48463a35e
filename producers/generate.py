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
   checkpoints, ``strawq.tasks.turns``; ``tools.checkpoint_every_*``); ``call_tool(...,
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

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from strawq.errors import ConfigError

from strawq.producers.generate_record import (JOURNAL_FULL_RETRY_MAX_S, Ended, Environment,
                                              Halted, SampleFailed, SampleHost,
                                              TrajectoryReplay)
from strawq.producers.generate_tools import NOT_APPLIED, TOOL_HALT_POLL_S, ToolCalls, ToolFn
from strawq.producers.plugins import is_async, resolve_with_args
from strawq.producers.sample import (LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, VERSION_DTYPE,
                                     SampleStatus)
from strawq.producers.trajectory import Trajectory, TrajectoryError

if TYPE_CHECKING:
    from strawq.producers.group import GroupRun
    from strawq.producers.sample import Sample

log = logging.getLogger(__name__)

GenerateFn = Callable[["GenerateContext"], Awaitable[None]]
DEFAULT_GENERATE = "strawq.producers.generate.single_turn"


@dataclass(frozen=True)
class Turn:
    """One generated turn: its tokens, how it ended (``stop`` / ``length``), and whether it
    was replayed from the record."""

    token_ids: list[int]
    finish: str
    text: str = ""
    replayed: bool = False


class GenerateContext:
    """What a generate plugin sees of the producer for one sample.

    Its engine turns and appended tokens are here; its replay of the record, environment
    restore and turn checkpoints are its ``TrajectoryReplay``
    (``strawq.producers.generate_record``), its tool calls its ``ToolCalls``
    (``strawq.producers.generate_tools``)."""

    def __init__(self, host: SampleHost, index: int, version: int) -> None:
        self._host = host
        run = host.run
        if run is None:
            raise TrajectoryError("a generate context needs a built group")
        self._run: GroupRun = run
        self.index = index
        self._version = version
        self._rec = TrajectoryReplay(host, run, index, version)
        self.trajectory: Trajectory = self._rec.trajectory
        self._tools = ToolCalls(host, run, index, self._rec)

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
        return self._rec.replaying

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

    async def _ended(self) -> None:
        """The sample ended: save its last turn if siblings still run
        (``TrajectoryReplay.ended``)."""
        await self._rec.ended()

    # -- operations ----------------------------------------------------------------------
    async def generate(self) -> Turn:
        """One turn: generate from prompt + response until the engine stops (stop token or
        budget). Raises :class:`Halted` when the producer stops the sample."""
        s = self.sample
        rec = self._rec
        e = rec.next_recorded("gen")
        if e is not None and e["end"] is not None:
            rec.pos += 1
            return Turn([int(t) for t in s.response_ids[e["start"]:e["end"]]], str(e["finish"]),
                        replayed=True)
        if e is None:
            limit = self._host.tools.max_turns
            if limit and self.trajectory.turns >= limit:
                self._end(SampleStatus.TRUNCATED, {"type": "length", "limit": "max_turns"})
        await rec.go_live()
        if e is None:
            e = {"op": "gen", "start": s.response_length, "end": None, "finish": None}
            rec.record(e)
        else:
            rec.record()
        cap = self._host.tools.max_turn_tokens
        s.turn_limit = int(e["start"]) + cap if cap else None
        try:
            finish = await self._host.generate_turn(self.index)
        finally:
            s.turn_limit = None
        if s.status is SampleStatus.COMPLETED or s.status is SampleStatus.TRUNCATED:
            s.status = SampleStatus.PENDING  # the turn ended; the plugin ends the sample
        e["end"], e["finish"] = s.response_length, finish
        rec.boundary()
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
        rec = self._rec
        e = rec.next_recorded("append")
        if e is not None:
            if not np.array_equal(s.response_ids[e["start"]:e["end"]], ids):
                raise TrajectoryError(f"sample {s.uid}: replayed append differs from the "
                                      "record; a generate plugin must be deterministic")
            rec.pos += 1
            return
        rec.ensure_live()  # the first live operation: the environment comes back first
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
        rec.record({"op": "append", "start": start, "end": s.response_length,
                    "kind": str(kind)})

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
        return await self._tools.call(name, args, fn, idempotent=idempotent,
                                      reconcile=reconcile)

    def finish(self, status: str = "completed", reason: Mapping[str, Any] | None = None) -> None:
        """End the sample: ``completed`` or ``truncated``. Raises
        :class:`~strawq.producers.trajectory.TrajectoryError` during the replay (the sample
        fails: an aborted turn is never trained as complete)."""
        self._rec.refuse_end_in_replay(f"finish({status!r})")
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
        self._rec.refuse_end_in_replay(f"fail({reason!r})")
        raise SampleFailed(reason, policy="fail_sample")

    def _end(self, status: SampleStatus, reason: dict[str, Any]) -> None:
        s = self.sample
        s.status = status
        s.finish_reason = dict(reason)
        raise Ended()


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
        except Ended:
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


__all__ = ["DEFAULT_GENERATE", "JOURNAL_FULL_RETRY_MAX_S", "NOT_APPLIED", "TOOL_HALT_POLL_S",
           "Environment", "GenerateContext", "GenerateFn", "Halted", "SampleFailed",
           "SampleHost", "ToolFn", "Turn", "load_generate", "run_plugin", "single_turn"]
