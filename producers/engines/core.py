"""The scheduler shared by the local engines: continuous batching, aborts, pauses, versions.

One asyncio task steps every running request together (one decode step = one token for
each), admitting waiting requests between steps up to ``max_running``. A backend
(``tiny``: a torch model; ``sim``: a timing model) does the actual prefill and decode.
All bookkeeping happens on the event-loop thread; only backend compute may run in a
worker thread, and it never touches the queues.

Semantics follow SGLang 0.5.x (docs/engines.md, "Protocol coverage and differences"):

* abort: by **exact rid** only (SGLang 0.5.23's tokenizer manager drops a rid that is not
  an exact live rid, so a prefix aborts nothing), or everything. Waiting requests finish at
  once with 0 tokens ("Abort in waiting queue"); running ones compute one more token and
  then finish with their partial tokens ("Aborted") — a pending abort wins over EOS, stop
  tokens and the length limit in that step, as in SGLang's ``Req.update_finish_state``. A
  second abort of the same rid is a no-op, and an abort that reaches a request still held
  at the pause gate is lost (SGLang marks the rid as aborted, but its scheduler does not
  know it yet), so such a request runs on after ``continue``.
* pause ``abort`` aborts everything in flight; ``retract`` puts running requests back in
  the waiting queue with their tokens (re-prefilled after continue); ``in_place`` just
  stops stepping and keeps the KV cache. While paused, new requests wait at the gate.
* an unpaused weight update closes the gate, waits until nothing is in flight (or aborts
  everything with ``abort_all_requests``), swaps weights, then reopens the gate.
* an update during an ``in_place`` pause with requests in flight loads the weights and
  stamps later tokens with the new version, but answers 400 (cache not flushed) and leaves
  the version label (``/model_info``) unchanged, as SGLang 0.5.23 does.
* each token is stamped with the weight version in force when it was computed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from strawq.errors import StrawqError

logger = logging.getLogger(__name__)

ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


@dataclass(frozen=True, kw_only=True)
class ReqParams:
    """Validated sampling parameters of one request (see ``wire.parse_sampling_params``)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    seed: int | None = None
    #: trailing input tokens that are the request's resumed prefix (custom_params), if sent
    resumed_tokens: int | None = None
    #: a streamed request's chunk interval in tokens (``stream_interval``; None: every token)
    stream_interval: int | None = None


@dataclass(eq=False)
class Req:
    """One request inside the engine."""

    rid: str
    input_ids: list[int]
    params: ReqParams
    seed: int
    done: asyncio.Future[None]
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    state: str = "new"  # new -> waiting -> running -> done (running -> waiting on retract)
    abort_requested: bool = False
    abort_lost: bool = False  # aborted while held at the pause gate: SGLang loses it
    num_retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    backend_state: Any = None
    #: set at each new token and at the end (a streamed request's reader clears it)
    progress: asyncio.Event | None = None

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.out_ids)


class Backend(Protocol):
    kind: str
    vocab_size: int
    context_length: int
    eos_token_id: int

    async def prefill(self, reqs: Sequence[Req]) -> None: ...

    async def decode(self, reqs: Sequence[Req]) -> list[tuple[int, float]]: ...

    def release(self, req: Req) -> None: ...

    async def load_weights(self, path: str) -> None: ...

    def model_info(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class UpdateRejected(StrawqError):
    """A weight update could not be applied; the message is returned to the caller."""


class EngineCore:
    def __init__(
        self,
        backend: Backend,
        *,
        max_running: int,
        weight_version: str = "0",
        model_path: str = "",
        update_wait_timeout_s: float = 600.0,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, found {max_running}")
        self.backend = backend
        self.max_running = max_running
        self.version = weight_version  # stamped on each token (the scheduler's)
        self.label = weight_version  # reported by /model_info (the tokenizer manager's)
        self.model_path = model_path
        self.update_wait_timeout_s = update_wait_timeout_s
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.live: dict[str, Req] = {}
        self.gated: dict[str, Req] = {}  # submitted, held at the pause / update gate
        self.abort_sent: set[str] = set()  # rids whose exact abort was already taken
        self.paused: str | None = None
        self.generated_tokens = 0
        self._updates_pending = 0
        self._gate = asyncio.Event()
        self._gate.set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._step_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-scheduler")

    async def stop(self) -> None:
        """Abort everything (waiting and gated requests too) and stop the scheduler."""
        if self.closed:
            return
        self.closed = True
        self._gate.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for req in list(self.live.values()):
            self._finish(req, dict(ABORT_RUNNING if req.state == "running" else ABORT_WAITING))
        await self.backend.close()

    # -- submission ---------------------------------------------------------------------
    async def submit(self, reqs: Sequence[Req], *, gate_timeout_s: float | None = None) -> None:
        """Wait at the gate (pause / pending update), enqueue, and wait for completion."""
        for req in reqs:
            if req.rid in self.live or req.rid in self.gated:
                raise ValueError(f"rid {req.rid!r} is already in flight; rids must be unique")
        for req in reqs:
            self.gated[req.rid] = req
        try:
            await asyncio.wait_for(self._wait_gate(), gate_timeout_s)
        finally:
            for req in reqs:
                self.gated.pop(req.rid, None)
        if self.closed:
            for req in reqs:
                self._finish(req, dict(ABORT_WAITING))
            return
        for req in reqs:
            if req.rid in self.live:
                raise ValueError(f"rid {req.rid!r} is already in flight; rids must be unique")
        for req in reqs:
            self.live[req.rid] = req
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            req.state = "waiting"
            self.waiting.append(req)
        if self.live:
            self._idle.clear()
        self._wake.set()
        await asyncio.gather(*(r.done for r in reqs))

    async def _wait_gate(self) -> None:
        while not self._gate.is_set():
            await self._gate.wait()

    def _refresh_gate(self) -> None:
        if self.closed or (self.paused is None and self._updates_pending == 0):
            self._gate.set()
        else:
            self._gate.clear()

    # -- the scheduler loop ---------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if self.paused is not None or not (self.waiting or self.running):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                async with self._step_lock:
                    await self._step()
            except Exception:  # a backend bug must not hang every client
                logger.exception(
                    "engine step failed; aborting %d running requests", len(self.running)
                )
                for req in list(self.running):
                    self._finish(req, dict(ABORT_RUNNING, message="Aborted: engine step failed"))
            await asyncio.sleep(0)

    async def _step(self) -> None:
        admitted: list[Req] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            req = self.waiting.popleft()
            req.state = "running"
            admitted.append(req)
        self.running.extend(admitted)
        if admitted:
            await self.backend.prefill(admitted)
        batch = list(self.running)
        if not batch:
            return
        results = await self.backend.decode(batch)
        version = self.version
        for req, (token, logprob) in zip(batch, results, strict=False):
            if req.state != "running":
                continue
            req.out_ids.append(int(token))
            req.out_logprobs.append(float(logprob))
            req.out_versions.append(version)
            self.generated_tokens += 1
            if req.progress is not None:
                req.progress.set()
            if req.abort_requested:  # a pending abort wins over EOS / stop / length
                self._finish(req, dict(ABORT_RUNNING))
                continue
            finish = self._check_finish(req, int(token))
            if finish is not None:
                self._finish(req, finish)

    def _check_finish(self, req: Req, token: int) -> dict[str, Any] | None:
        p = req.params
        n = len(req.out_ids)
        if n >= p.min_new_tokens:
            # SGLang 0.5.23: ignore_eos switches off every token-based stop, stop_token_ids
            # included (Req._check_token_based_finish returns early)
            if not p.ignore_eos and (
                token in p.stop_token_ids or token == self.backend.eos_token_id
            ):
                return {"type": "stop", "matched": token}
            if p.stop:
                tail = detokenize(req.out_ids[-64:])
                for s in p.stop:
                    if tail.endswith(s):
                        return {"type": "stop", "matched": s}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if req.seq_len >= self.backend.context_length:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _finish(self, req: Req, finish: dict[str, Any]) -> None:
        if req.state == "done":
            return
        if req.state == "running":
            self.backend.release(req)
            self.running.remove(req)
        elif req.state == "waiting":
            self.waiting.remove(req)
        req.state = "done"
        req.finish = finish
        self.live.pop(req.rid, None)
        self.abort_sent.discard(req.rid)
        if not req.done.done():
            req.done.set_result(None)
        if req.progress is not None:
            req.progress.set()
        if not self.live:
            self._idle.set()

    def _reap_aborts(self) -> None:
        for req in [r for r in self.running if r.abort_requested]:
            self._finish(req, dict(ABORT_RUNNING))

    # -- control --------------------------------------------------------------------------
    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Abort one exact live rid, or everything; returns how many requests were hit."""
        if not abort_all and not rid:
            return 0
        if abort_all or rid is None:
            targets = list(self.live.values())
        else:
            if rid in self.abort_sent:
                return 0  # SGLang: a second abort of the same rid is dropped
            if rid in self.gated:
                self.abort_sent.add(rid)  # taken, but the scheduler never sees it
                self.gated[rid].abort_lost = True
                return 0
            req = self.live.get(rid)
            targets = [] if req is None else [req]
            if req is not None:
                self.abort_sent.add(rid)
        hit = 0
        for req in targets:
            hit += 1
            if req.state == "waiting":
                self._finish(req, dict(ABORT_WAITING))
            else:
                req.abort_requested = True
        self._wake.set()
        if hit:
            logger.info("abort rid=%r all=%s: %d requests", rid, abort_all, hit)
        return hit

    async def pause(self, mode: str) -> None:
        async with self._step_lock:
            self.paused = mode
            self._refresh_gate()
            if mode == "abort":
                self.abort(abort_all=True)
                self._reap_aborts()
            elif mode == "retract":
                for req in reversed(list(self.running)):
                    self.backend.release(req)
                    self.running.remove(req)
                    req.state = "waiting"
                    req.num_retractions += 1
                    self.waiting.appendleft(req)
        logger.info(
            "paused (mode %s): %d running, %d waiting", mode, len(self.running), len(self.waiting)
        )

    async def cont(self) -> None:
        self.paused = None
        self._refresh_gate()
        self._wake.set()
        logger.info("generation continued")

    async def wait_idle(self, timeout_s: float | None) -> None:
        while self.live:
            self._idle.clear()
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def update_weights(
        self, path: str, version: str | None, *, abort_all_requests: bool, flush_cache: bool
    ) -> str:
        """Apply new weights; returns the success message, raises UpdateRejected."""
        if self.paused is None:
            self._updates_pending += 1
            self._refresh_gate()
            try:
                if abort_all_requests:
                    self.abort(abort_all=True)
                try:
                    await self.wait_idle(self.update_wait_timeout_s)
                except asyncio.TimeoutError:
                    raise UpdateRejected(
                        f"requests still in flight after {self.update_wait_timeout_s:.0f}s; pause "
                        "the engine or send abort_all_requests=true"
                    ) from None
                async with self._step_lock:
                    await self._apply(path, version)
            finally:
                self._updates_pending -= 1
                self._refresh_gate()
        else:
            async with self._step_lock:
                if abort_all_requests:
                    self.abort(abort_all=True)
                    self._reap_aborts()
                await self._apply(path, version)
                if flush_cache and self.paused == "in_place" and (self.running or self.waiting):
                    # SGLang 0.5.23: weights loaded, tokens stamped anew, label left stale
                    raise UpdateRejected(
                        "Weights were updated, but the cache was not flushed because requests are "
                        "still running or queued. Retract or finish them, then call /flush_cache."
                    )
        self.label = self.version
        return f"Succeeded to update model weights. Weight version updated to {self.version}."

    async def _apply(self, path: str, version: str | None) -> None:
        try:
            await self.backend.load_weights(path)
        except (OSError, ValueError, RuntimeError) as exc:
            raise UpdateRejected(f"Failed to load weights from {path}: {exc}") from exc
        self.model_path = path
        if version is not None:
            self.version = version
        logger.info("weights loaded from %s, version %s", path, self.version)

    def set_version(self, version: str, *, abort_all_requests: bool) -> None:
        if abort_all_requests:
            self.abort(abort_all=True)
        self.version = version
        self.label = version

    async def flush_cache(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.running or self.waiting:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def loads(self) -> dict[str, Any]:
        used = sum(r.seq_len for r in self.running)
        capacity = self.max_running * self.backend.context_length
        return {
            "dp_rank": 0,
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_used_tokens": used,
            "max_total_num_tokens": capacity,
            "max_running_requests": self.max_running,
            "token_usage": round(used / capacity, 4) if capacity else 0.0,
            "gen_throughput": 0.0,
            "num_paused_requests": len(self.waiting) if self.paused else 0,
        }


def detokenize(ids: Sequence[int]) -> str:
    """The local engines' "text": each id as a decimal, space-separated (``" 17 4 2"``)."""
    return "".join(f" {int(t)}" for t in ids)
