"""The generate context's tool calls: journalled, keyed, replayed, retried, detached.

``ToolCalls`` is the part of a sample's :class:`~strawq.producers.generate.GenerateContext`
behind ``ctx.call_tool``. A call replayed from the record returns the recorded result; a
live one gets its idempotency key (``strawq.producers.trajectory.idempotency_key``), is
journalled in the trajectory's ``inflight`` entry before it runs (durably first when it is
not idempotent), is retried on timeouts and errors (``tools.timeout_s``,
``tools.retries``; then ``tools.on_failure`` through :class:`SampleFailed`), and when the
producer halts the sample while it runs, is left running (``SampleHost.detach``) unless the
sample has an environment. An interrupted call that is not idempotent is reconciled
(``reconcile(args, key)``; :data:`NOT_APPLIED`: it runs now).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from strawq.producers.generate_record import Halted, SampleFailed, SampleHost, TrajectoryReplay
from strawq.producers.plugins import is_async
from strawq.producers.trajectory import TrajectoryError, idempotency_key

if TYPE_CHECKING:
    from strawq.producers.group import GroupRun

log = logging.getLogger(__name__)

ToolFn = Callable[[Any, str], Any]
#: how often a running tool call looks at the producer's halt (a pause, a stop): a call
#: running then is left to finish on its own (``GroupRunner.detached``)
TOOL_HALT_POLL_S = 0.02


class _NotApplied:
    def __repr__(self) -> str:
        return "NOT_APPLIED"


#: what a ``reconcile`` hook returns when the interrupted call took no effect (it runs now)
NOT_APPLIED: Any = _NotApplied()


class ToolCalls:
    """One sample's tool calls (see the module's docstring)."""

    def __init__(self, host: SampleHost, run: GroupRun, index: int,
                 rec: TrajectoryReplay) -> None:
        self._host = host
        self._run = run
        self._index = index
        self._rec = rec

    async def call(self, name: str, args: Any, fn: ToolFn, *, idempotent: bool = True,
                   reconcile: ToolFn | None = None) -> Any:
        """``GenerateContext.call_tool``: the journalled, replayed, retried tool call."""
        s = self._rec.sample
        e = self._rec.next_recorded("tool")
        if e is not None:
            if e["name"] != name:
                raise TrajectoryError(f"sample {s.uid}: replayed tool call {name!r} differs "
                                      f"from the recorded {e['name']!r}")
            self._rec.pos += 1
            self._host.bump("tool_calls_replayed")
            return e["result"]
        await self._rec.go_live()
        ordinal = len(self._rec.trajectory.tool_calls())
        t = self._rec.trajectory
        key = idempotency_key(self._run.task_id, self._index, t.epoch, ordinal, name, args,
                              s.response_ids.tolist(), gen=t.gen)
        journal = self._rec.trajectory.inflight
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
        t.inflight = {"key": key, "name": name, "args": args,
                      "idempotent": bool(idempotent), "started": started}
        if not idempotent:  # the journal entry is durable before the call can take effect
            await self._rec.save(force=True)
        self._host.check_halted()
        task = asyncio.ensure_future(self._attempts(name, args, fn, key))
        while True:
            done, _ = await asyncio.wait({task}, timeout=TOOL_HALT_POLL_S)
            if done:
                break
            if self._host.abandoned:
                task.cancel()
                raise Halted()
            if self._host.halted() and self._index not in self._run.envs:
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
            log.info("sample %s: %s (attempt %d)", self._rec.sample.uid, error, attempt)
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
        self._rec.trajectory.inflight = None
        self._rec.record(ev, boundary=True)
        return result
