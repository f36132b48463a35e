"""HTTP to SGLang-protocol engines: one session, bounded retries, authentication.

One :class:`Transport` owns one ``aiohttp.ClientSession`` (one connection pool). Every
call has a deadline. Faults (refused connections, resets, timeouts, HTTP 5xx, malformed
JSON) are retried a bounded number of times with exponential backoff and jitter, then
raised as a typed :class:`~strawq.producers.engine_errors.EngineError` naming the worker
URL. HTTP 4xx is raised at once as :class:`EngineRequestError` (401/403:
:class:`EngineAuthError`). Nothing else escapes: a caller that catches ``EngineError``
catches every engine failure.

Authentication (SGLang ``--api-key`` / ``--admin-api-key``): the API key is sent as
``Authorization: Bearer`` on every call; the control endpoints that SGLang marks
admin-optional (abort, pause, continue, weight updates, flush) get the admin key when one
is configured.

**A silent peer** (a network partition, a host that froze): every connection keeps TCP
keep-alive probes running, so one whose peer stops answering is closed by the kernel
about ``control_timeout_s`` after the peer fell silent, and the call in flight on it (a
``/generate`` waiting for its reply included) fails as :class:`EngineUnavailable` instead
of waiting out ``generate_timeout_s``. A peer that is busy but reachable answers the
probes, however long its reply takes (``keepalive_socket``).

The transport knows URLs and paths, never what a request means: the engine client
(``strawq.producers.sglang_client``) and the control calls
(``strawq.producers.sglang_control``) are built over it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import aiohttp

from strawq.config import Config
from strawq.errors import os_error_text
from strawq.producers.engine_errors import (
    EngineAuthError,
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
#: Endpoints SGLang 0.5.23 marks ADMIN_OPTIONAL: with --admin-api-key they need that key.
ADMIN_PATHS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weight_version",
    "/flush_cache"})


#: ``ClientConfig.routing_policy`` values (named as sglang-router's ``--policy``)
ROUTING_POLICIES = ("round_robin", "cache_aware")


@dataclass(frozen=True, kw_only=True)
class ClientConfig(Config):
    """Engine client settings: timeouts, retries, the pool, keys, routing, the version
    mapping. Every wait has a deadline. What a reply means for a sample (context length,
    EOS ids, the prefix warm-up) is the sample step's section
    (``strawq.producers.sample_step.GenerationConfig``, ``engine.generation``).

    Fields:
        connect_timeout_s: TCP connect timeout per attempt.
        generate_timeout_s: the segment deadline. A ``/generate`` still running after it is
            aborted by its rid on the engine; the aborted reply carries every token
            generated so far (kept: the sample resumes from the longer prefix). Only an
            engine that does not answer even the abort within ``control_timeout_s`` is a
            fault (retried from the old prefix). The default is far above any expected
            segment: it bounds a stuck request, it does not shape generation.
        control_timeout_s: total time for one control call attempt (abort, loads, ...),
            and how long an aborted ``/generate`` may take to come back; also about how
            long a connection whose peer stopped answering TCP keep-alive probes stays
            open, or data sent into it stays unacknowledged (a partition ends a call in
            flight after about this long, not after the deadline).
        weight_update_timeout_s: one ``/update_weights_from_disk`` attempt (it may wait
            for in-flight requests on an unpaused engine).
        max_retries: retries after the first attempt for retryable faults.
        backoff_base_s / backoff_max_s: exponential backoff bounds.
        jitter: fraction of random extra delay added to each backoff (0..1).
        pool_limit: maximum simultaneous connections of the pool.
        default_version: map SGLang's non-numeric ``"default"`` version to this int
            (None: such a version is an error). Read where replies are parsed: the
            client's ``/generate`` and its version probe (``weight_version``).
        api_key: SGLang ``--api-key``; sent as a bearer token on every call.
        admin_api_key: SGLang ``--admin-api-key``; sent instead on the admin endpoints
            (abort, pause, continue, weight updates, flush).
        routing_policy: how ``/generate`` picks a worker when there is no router
            (sglang-router's policy names): ``round_robin``, or ``cache_aware`` — every
            request of one task (a group's G samples, their resumes after an update, every
            turn of a trajectory) goes to one engine, so it finds the shared prefix in that
            engine's radix cache. The engine is chosen by rendezvous hashing of the task id
            over the workers in rotation (a worker leaving moves only its own tasks); a
            retry goes to the task's next engine. Behind a router, configure the router's
            own ``--policy cache_aware``.
        stream: send ``/generate`` with ``"stream": true`` (SGLang's field) and read the
            reply chunk by chunk: the producer holds every token as it arrives
            (``Sample.streamed``), and an engine or connection that dies mid-segment
            costs only the tokens not yet received (the sample resumes from the rest on
            another engine). False: one reply per segment; a segment cut by a fault is
            lost and generated again.
        stream_interval: tokens per streamed chunk (SGLang's per-request
            ``sampling_params.stream_interval``; the first token comes at once): what a
            dying engine may cost at most. SGLang's chunks are cumulative (the whole reply
            so far), so the bytes sent grow as n²/(2·interval) for an n-token segment.
    """

    connect_timeout_s: float = 5.0
    generate_timeout_s: float = 3600.0
    control_timeout_s: float = 30.0
    weight_update_timeout_s: float = 600.0
    max_retries: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    jitter: float = 0.5
    pool_limit: int = 1024
    default_version: int | None = None
    api_key: str | None = field(default=None, repr=False)  # never in a repr or log
    admin_api_key: str | None = field(default=None, repr=False)
    routing_policy: str = "round_robin"
    stream: bool = False
    stream_interval: int = 256

    _moved_keys: ClassVar[Mapping[str, str]] = {
        "context_length": "engine.generation.context_length",
        "eos_token_ids": "engine.generation.eos_token_ids",
        "warm_prefix": "engine.generation.warm_prefix",
    }

    def validate(self) -> None:
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"ClientConfig.routing_policy must be one of {ROUTING_POLICIES}, "
                             f"found {self.routing_policy!r}")
        for name in (
            "connect_timeout_s",
            "generate_timeout_s",
            "control_timeout_s",
            "weight_update_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClientConfig.{name} must be > 0, found {getattr(self, name)!r}")
        if self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries must be >= 0, found {self.max_retries}")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("ClientConfig needs 0 <= backoff_base_s <= backoff_max_s")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"ClientConfig.jitter must be in [0, 1], found {self.jitter}")
        if self.stream_interval < 1:
            raise ValueError(f"ClientConfig.stream_interval must be >= 1, found "
                             f"{self.stream_interval}")
        if self.pool_limit < 1:
            raise ValueError(f"ClientConfig.pool_limit must be >= 1, found {self.pool_limit}")


def keepalive_socket(silent_s: float) -> Callable[[Any], socket.socket]:
    """aiohttp's ``socket_factory``: sockets whose kernel closes the connection once the
    peer has not answered for about ``silent_s``: keep-alive probes on an idle connection
    (idle half of it, then three probes over the other half; whole seconds, at least one
    each), the TCP user timeout on data sent and not acknowledged."""
    idle = max(1, math.ceil(silent_s / 2))
    interval = max(1, math.ceil(silent_s / 6))

    def make(addr_info: Any) -> socket.socket:
        family, kind, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=kind, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # keep-alive bounds a silent peer on an idle connection (a reply awaited), the
        # user timeout one on a connection with data unacknowledged (a request sent
        # into the partition)
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                            ("TCP_KEEPCNT", 3),
                            ("TCP_USER_TIMEOUT", max(1000, math.ceil(silent_s * 1000)))):
            opt = getattr(socket, name, None)  # Linux; elsewhere the system's defaults
            if opt is not None:
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        return sock
    return make


class Retryable(Exception):
    """A fault worth retrying; :meth:`Transport.with_retries` unwraps it (it never leaves
    the engine client)."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(str(error))
        self.error = error


class Transport:
    """The session, the retries and the auth headers of one engine client."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._rng = random.Random()

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.config.pool_limit, limit_per_host=0,
                socket_factory=keepalive_socket(self.config.control_timeout_s))
            self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(
                "the engine client is not started; use 'async with SGLangClient(...)' or "
                "await start()"
            )
        return self._session

    # -- retries ----------------------------------------------------------------------------
    def backoff(self, attempt: int) -> float:
        base = min(self.config.backoff_max_s, self.config.backoff_base_s * (2.0**attempt))
        return float(base * (1.0 + self.config.jitter * self._rng.random()))

    async def with_retries(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """``op()``, retried on :class:`Retryable` up to ``max_retries`` times."""
        attempt = 0
        while True:
            try:
                return await op()
            except Retryable as exc:
                if attempt >= self.config.max_retries:
                    raise exc.error from None
                delay = self.backoff(attempt)
                logger.warning("%s failed (%s); retry %d/%d in %.2fs", what, exc.error,
                               attempt + 1, self.config.max_retries, delay)
                attempt += 1
                await asyncio.sleep(delay)

    def auth_headers(self, path: str) -> dict[str, str] | None:
        key = self.config.api_key
        if path in ADMIN_PATHS and self.config.admin_api_key:
            key = self.config.admin_api_key
        return None if key is None else {"Authorization": f"Bearer {key}"}

    # -- one attempt ------------------------------------------------------------------------
    async def attempt(
        self,
        method: str,
        base: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float,
    ) -> bytes:
        """One HTTP call; a retryable fault is raised as :class:`Retryable`."""
        return await self._request(method, base, path, body=body, params=params,
                                   timeout_s=timeout_s, on_line=None)

    async def attempt_stream(
        self,
        base: str,
        path: str,
        *,
        body: Any,
        timeout_s: float,
        on_line: Callable[[bytes], None],
    ) -> bytes:
        """One POST whose 2xx ``text/event-stream`` reply is read line by line as it
        arrives (a streamed ``/generate``: ``on_line`` gets each line, and may raise to end
        the call; returns b""); a reply of another type (a server that does not stream) is
        returned whole. The faults are those of :meth:`attempt`, a connection that breaks
        mid-reply included."""
        return await self._request("POST", base, path, body=body, params=None,
                                   timeout_s=timeout_s, on_line=on_line)

    async def _request(
        self,
        method: str,
        base: str,
        path: str,
        *,
        body: Any,
        params: Mapping[str, str] | None,
        timeout_s: float,
        on_line: Callable[[bytes], None] | None,
    ) -> bytes:
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.config.connect_timeout_s)
        try:
            async with self.session.request(
                method, base + path, json=body, params=params, timeout=timeout,
                headers=self.auth_headers(path),
            ) as resp:
                status = resp.status
                if on_line is None or status >= 300 or resp.content_type != "text/event-stream":
                    data = await resp.read()
                else:
                    data = b""
                    async for line in resp.content:
                        on_line(line)
        except asyncio.TimeoutError as exc:
            if getattr(exc, "errno", None) is not None:  # ETIMEDOUT: the kernel gave up
                raise Retryable(EngineUnavailable(
                    f"{method} {path}: connection lost, the engine stopped answering "
                    f"({_reason(exc)}; a network partition or a frozen host)", url=base)
                ) from None
            raise Retryable(
                EngineTimeout(f"{method} {path} timed out after {timeout_s:.1f}s", url=base)
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise Retryable(
                EngineUnavailable(f"{method} {path}: cannot connect ({_reason(exc.os_error)})",
                                  url=base)
            ) from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise Retryable(
                EngineUnavailable(
                    f"{method} {path}: connection failed ({type(exc).__name__}: {_reason(exc)})",
                    url=base
                )
            ) from None
        if status >= 500:
            raise Retryable(
                EngineUnavailable(f"{method} {path}: HTTP {status}: {snippet(data)}", url=base)
            )
        if status in (401, 403):
            which = "admin key" if path in ADMIN_PATHS else "API key"
            raise EngineAuthError(
                f"{method} {path} refused: HTTP {status}: {_error_message(data)}; check the "
                f"{which} (ClientConfig.api_key / admin_api_key, SGLang --api-key / "
                "--admin-api-key)",
                url=base,
                status=status,
            )
        if status >= 400:
            raise EngineRequestError(
                f"{method} {path} rejected: HTTP {status}: {_error_message(data)}",
                url=base,
                status=status,
            )
        return data

    # -- retried calls ----------------------------------------------------------------------
    async def call_raw(
        self,
        method: str,
        base: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float,
    ) -> bytes:
        async def op() -> bytes:
            return await self.attempt(method, base, path, body=body, params=params,
                                      timeout_s=timeout_s)

        return await self.with_retries(op, f"{method} {base}{path}")

    async def call_json(
        self,
        method: str,
        base: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float,
    ) -> Any:
        data = await self.call_raw(method, base, path, body=body, params=params,
                                   timeout_s=timeout_s)
        try:
            return decode_json(data, base, path)
        except Retryable as exc:  # malformed JSON is not retried, and never escapes
            raise exc.error from None


def snippet(data: bytes, limit: int = 200) -> str:
    return data[:limit].decode("utf-8", errors="replace")


def _error_message(data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return snippet(data)
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
        if "message" in body:
            return str(body["message"])
    return snippet(data)


def decode_json(data: bytes, url: str, path: str) -> Any:
    """The JSON body; malformed JSON is a :class:`Retryable` protocol error."""
    try:
        return json.loads(data)
    except ValueError:
        raise Retryable(
            EngineProtocolError(f"{path} returned malformed JSON: {snippet(data, 120)!r}", url=url)
        ) from None


def _reason(exc: BaseException) -> str:
    """An OS-level failure in words (no ``[Errno N]``), anything else as it reads."""
    return os_error_text(exc) if isinstance(exc, OSError) and exc.errno else str(exc)
