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
   with new keys (``Trajectory.gen``).

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
from typing import TYPE_CHECKING, Any

import numpy as np

from strawq.errors import ConfigError, StrawqError

from strawq.producers.plugins import is_async, resolve_with_args
from strawq.producers.sample import (LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, VERSION_DTYPE,
                                     SampleStatus)
from strawq.producers.trajectory import Trajectory, TrajectoryError, idempotency_key

if TYPE_CHECKING:
    from strawq.producers.group import GroupRun
    from strawq.producers.runner import ActiveGroup, GroupRunner
    from strawq.producers.sample import Sample

log = logging.getLogger(__name__)

GenerateFn = Callable[["GenerateContext"], Awaitable[None]]
ToolFn = Callable[[Any, str], Any]
DEFAULT_GENERATE = "strawq.producers.generate.single_turn"


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


class GenerateContext:
    """What a generate plugin sees of the producer for one sample."""

    def __init__(self, runner: GroupRunner, active: ActiveGroup, index: int,
                 version: int) -> None:
        self._runner = runner
        self._a = active
        run = active.run
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

    # -- what the plugin reads -----------------------------------------------------------
    @property
    def sample(self) -> Sample:
        return self._run.samples[self.index]

    @property
    def task(self) -> dict[str, Any]:
        return self._run.lease.task

    @property
    def replaying(self) -> bool:
        return self._pos < len(self.trajectory.events)

    @property
    def remaining_budget(self) -> int:
        return self.sample.remaining_budget(self._runner.config.engine.client.context_length)

    def token_ids(self) -> list[int]:
        """Prompt + response so far: the next turn's input."""
        return self.sample.resume_input_ids()

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
            limit = self._runner.config.tools.max_turns
            if limit and self.trajectory.turns >= limit:
                self._end(SampleStatus.TRUNCATED, {"type": "length", "limit": "max_turns"})
            e = {"op": "gen", "start": s.response_length, "end": None, "finish": None}
            self.trajectory.events.append(e)
        self._pos = len(self.trajectory.events)
        finish = await self._runner.generate_turn(self._a, self.index)
        if s.status is SampleStatus.COMPLETED or s.status is SampleStatus.TRUNCATED:
            s.status = SampleStatus.PENDING  # the turn ended; the plugin ends the sample
        e["end"], e["finish"] = s.response_length, finish
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

    async def call_tool(self, name: str, args: Any, fn: ToolFn) -> Any:
        """Call ``fn(args, key)`` once for this point of the trajectory (replayed calls
        return the recorded result). Timeouts and errors are retried, then the failure
        policy applies (:class:`SampleFailed`)."""
        s = self.sample
        e = self._next_recorded("tool")
        if e is not None:
            if e["name"] != name:
                raise TrajectoryError(f"sample {s.uid}: replayed tool call {name!r} differs "
                                      f"from the recorded {e['name']!r}")
            self._pos += 1
            self._runner.book.bump("tool_calls_replayed")
            return e["result"]
        cfg = self._runner.config
        ordinal = len(self.trajectory.tool_calls())
        key = idempotency_key(self._run.task_id, self.index, self.trajectory.epoch, ordinal,
                              name, args, s.response_ids.tolist(), gen=self.trajectory.gen)
        error = ""
        t0, started = time.monotonic(), time.time()
        for attempt in range(1, cfg.tools.retries + 2):
            self._runner.check_halted(self._a)
            try:
                if is_async(fn):
                    result = await asyncio.wait_for(fn(args, key), cfg.tools.timeout_s)
                else:
                    result = await asyncio.wait_for(self._runner.rewards.call(fn, args, key),
                                                    cfg.tools.timeout_s)
                    if inspect.isawaitable(result):
                        result = await asyncio.wait_for(result, cfg.tools.timeout_s)
            except TimeoutError:
                error = f"tool {name!r} timed out after {cfg.tools.timeout_s}s"
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the sample's
                error = f"tool {name!r} failed: {type(exc).__name__}: {exc}"[:500]
            else:
                seconds = time.monotonic() - t0
                self._runner.book.bump("tool_calls")
                self._runner.book.hop("tool", seconds)
                self.trajectory.events.append({"op": "tool", "key": key, "name": name,
                                               "args": args, "result": result,
                                               "attempts": attempt, "seconds": seconds,
                                               "started": started})
                self._pos = len(self.trajectory.events)
                return result
            self._runner.book.bump("tool_errors")
            log.info("sample %s: %s (attempt %d)", s.uid, error, attempt)
        raise SampleFailed(error, policy=cfg.tools.on_failure)

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


async def run_plugin(runner: GroupRunner, a: ActiveGroup, i: int, version: int) -> None:
    """Run the generate plugin on sample ``i`` until it ends or is halted. A failure
    (tool, plugin bug) ends the sample as failed, or drops the group, or restarts the
    sample in a fresh environment, per ``tools.on_failure``; :class:`Halted` propagates."""
    run = a.run
    if run is None:
        return
    restarts = 0
    while True:
        ctx = GenerateContext(runner, a, i, version)
        s = run.samples[i]
        try:
            await runner.generate_fn(ctx)
            if not s.is_final:
                raise SampleFailed("the generate plugin returned without ending the sample "
                                   "(call ctx.finish)")
            return
        except _Ended:
            return
        except SampleFailed as exc:
            if exc.policy == "restart" and restarts < runner.config.tools.retries:
                restarts += 1
                run.restart_sample(i)
                log.info("sample %s: restarting in a fresh environment (%s)", s.uid, exc)
                continue
            if exc.policy == "drop_group":
                a.drop = ("tool_error", str(exc))
                runner.stop_samples(a, keep=i)
                raise Halted() from None
            run.fail_sample(i, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a plugin bug fails its sample, not the loop
            log.exception("sample %s: the generate plugin raised", s.uid)
            run.fail_sample(i, f"generate plugin raised {type(exc).__name__}: {exc}"[:500])
            return


__all__ = ["DEFAULT_GENERATE", "GenerateContext", "GenerateFn", "Halted",
           "SampleFailed", "Turn", "load_generate", "run_plugin",
           "single_turn"]
