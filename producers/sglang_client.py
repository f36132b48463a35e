"""Async client for SGLang 0.5.x engines (and strawq's local engines), native HTTP protocol.

One :class:`SGLangClient` per process, over one
:class:`~strawq.producers.engine_transport.Transport` (the session, the retries, the auth
headers). ``/generate`` goes to the router when one is configured, otherwise round-robin
over the worker list (or the subset a caller allows: the version guard's rotation); the
control calls (:class:`~strawq.producers.sglang_control.EngineControl`: abort, pause,
weight updates, …) always go to each worker directly, because sglang-router 0.3.x does not
route them (docs/engines.md). The client speaks the protocol and nothing else: what
a reply means for a sample (budget, version, applying it) is the producer's sample step
(``strawq.producers.sample_step``).

**The segment deadline.** A ``/generate`` still running ``generate_timeout_s`` after it was
sent is aborted by its exact rid on the engine, and its reply (an abort carrying every token
generated so far) is returned as the segment, marked ``deadline_abort``: the caller keeps
the tokens and resumes from the longer prefix. Only a request that does not come back
``control_timeout_s`` after its abort is a fault (retried from the old prefix).

**Streaming** (``ClientConfig.stream``): ``/generate`` is sent with ``"stream": true``
and read as it arrives (``strawq.producers.sglang_protocol.StreamReader``: SSE, cumulative
chunks, each checked as a whole reply); the caller's ``on_chunk`` gets every chunk before
the last, and the last is the reply, the same as unstreamed. A fault after tokens arrived
is not retried by the client (a retry from the old prefix would drop them): it is raised,
and the sample step keeps what arrived and resumes from there.

Aborts are by **exact rid** (SGLang 0.5.23 ignores a rid prefix: docs/engines.md).
The client gives every request a rid; a retried attempt gets its own (``<rid>~retry<n>``),
and every wire rid in flight is in the caller's ``live`` set (and the client's own record:
:meth:`SGLangClient.abort_matching`), so an abort can name each one. The client returns the
engine's reply as it is: an aborted reply that ends on a stop token (the real scheduler
applies a pending abort before its stop check) is made final by the sample step
(``strawq.producers.sample_step``), which knows the model's EOS ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableSet, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from typing_extensions import Self

from strawq.producers.engine_errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from strawq.producers.engine_transport import (
    ADMIN_PATHS,
    ClientConfig,
    Retryable,
    Transport,
    decode_json,
)
from strawq.producers.sglang_control import EngineControl
from strawq.producers.sglang_protocol import (
    GenerateResult,
    StreamReader,
    build_generate_payload,
    parse_generate_body,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["ADMIN_PATHS", "ClientConfig", "SGLangClient", "WorkerInfo", "parse_workers"]


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as listed by the router's ``GET /workers`` (or a configured URL)."""

    url: str
    id: str | None = None
    is_healthy: bool = True
    load: int | None = None


def parse_workers(body: Any, *, url: str | None = None) -> list[WorkerInfo]:
    """Parse sglang-router 0.3.x ``GET /workers``: ``{"workers": [{"id","url",...}], "total"}``."""
    if not isinstance(body, Mapping) or not isinstance(body.get("workers"), list):
        raise EngineProtocolError(
            f"GET /workers must return {{'workers': [...], 'total': n}}, found {str(body)[:120]}",
            url=url,
        )
    out = []
    for item in body["workers"]:
        if not isinstance(item, Mapping) or not isinstance(item.get("url"), str):
            raise EngineProtocolError(
                f"worker entry must have a string 'url', found {item!r}", url=url
            )
        load = item.get("load")
        out.append(
            WorkerInfo(
                url=item["url"].rstrip("/"),
                id=None if item.get("id") is None else str(item["id"]),
                is_healthy=bool(item.get("is_healthy", True)),
                load=load if isinstance(load, int) and not isinstance(load, bool) else None,
            )
        )
    return out



@dataclass
class _Inflight:
    """One ``/generate`` call in flight: the caller's rid and the worker it went to."""

    logical_rid: str
    url: str



def affinity_key(rid: str) -> str | None:
    """The task a producer's rid belongs to (``<producer>/<task>.g<gen>/<sample>.<n>``,
    ``strawq.producers.group.GroupRun.next_rid``), the key ``cache_aware`` routing keeps
    on one engine; None for a rid of another shape (it goes round-robin)."""
    parts = rid.split("/")
    if len(parts) < 3 or not parts[0]:
        return None
    task, sep, gen = parts[1].rpartition(".g")
    return task if sep and task and gen.isdigit() else None


def rendezvous(key: str, urls: Sequence[str]) -> list[str]:
    """``urls`` in the order of ``key``'s rendezvous (highest random weight) hash: the first
    is its engine, the rest its fall-backs; a worker joining or leaving moves only the keys
    whose first choice it is."""
    def weight(url: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(),
                                              digest_size=8).digest(), "big")
    return sorted(urls, key=weight, reverse=True)

class SGLangClient(EngineControl):
    """Async SGLang client. Use as ``async with SGLangClient([...]) as client:``.

    The control calls (abort, pause, weight updates, loads, model info) are inherited from
    :class:`~strawq.producers.sglang_control.EngineControl`: they go to each worker directly.
    """

    def __init__(
        self,
        workers: Sequence[str] = (),
        *,
        router_url: str | None = None,
        config: ClientConfig | None = None,
    ) -> None:
        if not workers and router_url is None:
            raise ValueError("SGLangClient needs worker URLs or a router_url; found neither")
        self.config = config or ClientConfig()
        self.router_url = router_url.rstrip("/") if router_url else None
        self._workers = [WorkerInfo(url=w.rstrip("/")) for w in workers]
        self._rr = 0
        self.transport = Transport(self.config)
        self._inflight: dict[str, _Inflight] = {}
        #: segments that ran past ``generate_timeout_s`` and were aborted (tokens kept)
        self.deadline_aborts = 0

    # -- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the session; in router mode also discover the workers."""
        await self.transport.start()
        if self.router_url is not None and not self._workers:
            await self.refresh_workers()

    async def close(self) -> None:
        await self.transport.close()

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self._workers]

    async def refresh_workers(self) -> list[WorkerInfo]:
        """Re-read the worker list from the router (no-op list without a router)."""
        if self.router_url is None:
            return list(self._workers)
        body = await self.transport.call_json(
            "GET", self.router_url, "/workers", timeout_s=self.config.control_timeout_s
        )
        self._workers = parse_workers(body, url=self.router_url)
        logger.info("router %s lists %d workers", self.router_url, len(self._workers))
        return list(self._workers)

    def _next_generate_url(self, among: Sequence[str] | None, rid: str = "",
                           attempt: int = 0) -> str:
        if self.router_url is not None:
            return self.router_url
        urls = self.worker_urls if among is None else list(among)
        if not urls:
            raise EngineUnavailable("no worker to send /generate to (the worker list is empty)")
        key = affinity_key(rid) if self.config.routing_policy == "cache_aware" else None
        if key is not None:
            return rendezvous(key, urls)[attempt % len(urls)]
        url = urls[self._rr % len(urls)]
        self._rr += 1
        return url

    # -- generation ---------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str | None = None,
        url: str | None = None,
        among: Sequence[str] | None = None,
        timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
        live: MutableSet[str] | None = None,
        on_chunk: Callable[[GenerateResult], None] | None = None,
    ) -> GenerateResult:
        """One ``/generate`` call (n=1). Retries go to the next worker when ``url`` is None
        (round-robin over ``among`` when given, else every worker); each wire rid in flight
        is in ``live`` while it is. With ``ClientConfig.stream`` the reply is streamed and
        ``on_chunk`` gets each non-final chunk (the reply so far, abort-shaped)."""
        results = await self.generate_many(
            input_ids, sampling_params, rid=rid, url=url, among=among, timeout_s=timeout_s,
            extra=extra, live=live, on_chunk=on_chunk)
        if len(results) != 1:
            raise EngineProtocolError(
                f"expected one /generate result, found {len(results)}", url=results[0].url
            )
        return results[0]

    async def generate_many(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str | None = None,
        url: str | None = None,
        among: Sequence[str] | None = None,
        timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
        live: MutableSet[str] | None = None,
        on_chunk: Callable[[GenerateResult], None] | None = None,
    ) -> list[GenerateResult]:
        """``/generate`` returning every result; ``n>1`` becomes n abortable requests.

        SGLang 0.5.23 gives the sub-requests of an ``n>1`` call random rids, so none of
        them could be aborted alone; the client sends n requests with rids
        ``{rid}#{i}.`` instead (no sub-rid is a prefix of another) and returns the n
        results in order.
        """
        if len(input_ids) == 0:
            raise ValueError("input_ids is empty; SGLang rejects empty input_ids")
        params = dict(sampling_params)
        n = params.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sampling_params.n must be an int >= 1, found {n!r}")
        base = rid if rid is not None else uuid.uuid4().hex
        one = _Call(url=url, among=among, timeout_s=timeout_s, extra=extra, live=live,
                    on_chunk=on_chunk)
        if n == 1:
            return [await self._generate_one(input_ids, params, base, one)]
        single = {k: v for k, v in params.items() if k != "n"}
        seed = single.get("sampling_seed")
        calls = []
        for i in range(n):
            sub = dict(single)
            if isinstance(seed, int) and not isinstance(seed, bool):
                sub["sampling_seed"] = seed + i
            calls.append(self._generate_one(input_ids, sub, f"{base}#{i}.", one))
        return list(await asyncio.gather(*calls))

    async def _generate_one(
        self, input_ids: Sequence[int], params: dict[str, Any], rid: str, call: _Call
    ) -> GenerateResult:
        stream = self.config.stream
        if stream and self.config.stream_interval > 1:
            params = {"stream_interval": self.config.stream_interval, **params}
        payload = build_generate_payload(input_ids, params, rid=rid, extra=call.extra,
                                         stream=stream)
        deadline = call.timeout_s or self.config.generate_timeout_s
        attempts = 0

        async def op() -> GenerateResult:
            nonlocal attempts
            if attempts:
                # A failed attempt may still run on the engine under the old rid: the
                # retry gets its own rid, and both stay abortable by exact rid.
                payload["rid"] = f"{rid}~retry{attempts}"
            attempts += 1
            target = call.url or self._next_generate_url(call.among, rid, attempts - 1)
            wire_rid = str(payload["rid"])
            self._inflight[wire_rid] = _Inflight(logical_rid=rid, url=target)
            if call.live is not None:
                call.live.add(wire_rid)
            try:
                if stream:
                    result, cut = await self._stream_generate(target, payload, wire_rid,
                                                              deadline, call.on_chunk)
                    return dataclasses.replace(result, deadline_abort=True) if cut else result
                data, cut = await self._deadline(target, wire_rid, deadline, self.transport.attempt(
                    "POST", target, "/generate", body=payload,
                    timeout_s=deadline + 2 * self.config.control_timeout_s + 1.0))
            finally:
                self._inflight.pop(wire_rid, None)
                if call.live is not None:
                    call.live.discard(wire_rid)
            result = self._one(decode_json(data, target, "/generate"), target, wire_rid)
            return dataclasses.replace(result, deadline_abort=True) if cut else result

        return await self.transport.with_retries(op, f"/generate rid={rid}")

    def _one(self, body: Any, target: str, wire_rid: str) -> GenerateResult:
        """The one result of a whole ``/generate`` reply (a protocol fault: Retryable)."""
        try:
            results = parse_generate_body(
                body, url=target, default_version=self.config.default_version
            )
        except EngineProtocolError as exc:
            raise Retryable(exc) from None
        if len(results) != 1:
            raise Retryable(
                EngineProtocolError(
                    f"expected one /generate result for rid {wire_rid}, found {len(results)}",
                    url=target,
                )
            )
        return results[0]

    async def _stream_generate(
        self, target: str, payload: dict[str, Any], wire_rid: str, deadline: float,
        on_chunk: Callable[[GenerateResult], None] | None,
    ) -> tuple[GenerateResult, bool]:
        """One streamed ``/generate`` attempt: each chunk so far goes to ``on_chunk``.
        A fault after a chunk with tokens is raised as it is, not retried here: a retry
        from the old prefix would throw those tokens away; the caller keeps them (the
        sample step applies what it received) and resumes from the longer prefix."""
        reader = StreamReader(url=target, default_version=self.config.default_version)

        def line(raw: bytes) -> None:
            chunk = reader.feed(raw)
            if chunk is not None and on_chunk is not None and reader.holdable(chunk):
                on_chunk(chunk)

        def received() -> bool:
            return reader.last is not None and len(reader.last.output_ids) > 0

        try:
            whole, cut = await self._deadline(target, wire_rid, deadline,
                                              self.transport.attempt_stream(
                target, "/generate", body=payload, on_line=line,
                timeout_s=deadline + 2 * self.config.control_timeout_s + 1.0))
            if whole:  # a server that does not stream answered the whole reply
                return self._one(decode_json(whole, target, "/generate"), target, wire_rid), cut
            return reader.result(), cut
        except Retryable as exc:
            if received():
                raise exc.error from None
            raise
        except EngineUnavailable:  # the stream ended before its final chunk
            if received():
                raise
            raise Retryable(EngineUnavailable(
                "/generate stream ended before its first chunk", url=target)) from None
        except EngineRequestError:
            raise
        except EngineProtocolError as exc:
            if received():
                raise
            raise Retryable(exc) from None

    async def _deadline(self, target: str, wire_rid: str, deadline: float,
                        work: Awaitable[T]) -> tuple[T, bool]:
        """Run the ``/generate`` call ``work``; past ``deadline`` abort ``wire_rid`` and take
        the aborted reply (its tokens are the segment). Returns what ``work`` returned and
        whether the deadline cut it."""
        grace = self.config.control_timeout_s
        # the HTTP bound outlasts the deadline, the abort and the wait for its reply
        post = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({post}, timeout=deadline)
            if post in done:
                return post.result(), False
            self.deadline_aborts += 1
            logger.warning("/generate rid=%s still runs %.1fs after it was sent (the segment "
                           "deadline, ClientConfig.generate_timeout_s): aborting it on the "
                           "engine; its tokens are kept and the sample resumes from them",
                           wire_rid, deadline)
            try:  # behind a router the worker is unknown: every worker gets the abort
                await asyncio.wait_for(self.abort_rids(
                    [wire_rid], url=None if target == self.router_url else target), grace)
            except (EngineError, asyncio.TimeoutError) as exc:
                logger.warning("abort of %s past its deadline failed: %s", wire_rid, exc)
            done, _ = await asyncio.wait({post}, timeout=grace)
            if post in done:
                return post.result(), True
            raise Retryable(EngineTimeout(
                f"/generate rid={wire_rid} ran past its deadline of {deadline:.1f}s and did not "
                f"come back {grace:.1f}s after its abort", url=target))
        finally:
            if not post.done():
                post.cancel()
                await asyncio.gather(post, return_exceptions=True)

    # -- rids in flight ---------------------------------------------------------------------
    def inflight_rids(self, prefix: str = "") -> list[str]:
        """Wire rids of the ``/generate`` calls now in flight whose caller rid starts with
        ``prefix`` (the client-side selection that SGLang's exact-rid abort cannot do)."""
        return [w for w, f in self._inflight.items() if f.logical_rid.startswith(prefix)]

    async def abort_matching(self, prefix: str, *, url: str | None = None) -> list[str]:
        """Abort, by exact rid and on every worker, each request in flight whose caller rid
        starts with ``prefix``; returns the wire rids aborted (empty: nothing was live)."""
        rids = self.inflight_rids(prefix)
        if rids:
            await self.abort_rids(rids, url=url)
        return rids

    async def health_generate(self, url: str, *, timeout_s: float | None = None) -> bool:
        """True when the worker answers ``/health_generate`` with 200 (no retries)."""
        try:
            await self.transport.attempt(
                "GET", url, "/health_generate",
                timeout_s=timeout_s or self.config.control_timeout_s)
            return True
        except (Retryable, EngineRequestError):
            return False


@dataclass(frozen=True)
class _Call:
    """How one ``generate`` call is sent (shared by its n sub-requests)."""

    url: str | None
    among: Sequence[str] | None
    timeout_s: float | None
    extra: Mapping[str, Any] | None
    live: MutableSet[str] | None
    on_chunk: Callable[[GenerateResult], None] | None = None
