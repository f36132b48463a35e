"""Async client for SGLang 0.5.x engines (and strawq's local engines), native HTTP protocol.

One :class:`SGLangClient` per process owns one ``aiohttp.ClientSession`` (one connection
pool). ``/generate`` goes to the router when one is configured, otherwise round-robin over
the worker list; control calls (abort, pause, weight updates, …) always go to each worker
directly, because sglang-router 0.3.x does not route them (protocol reference §7).

Faults (refused connections, resets, timeouts, HTTP 5xx, malformed JSON or shapes) are
retried a bounded number of times with exponential backoff and jitter, then raised as a
typed :class:`~strawq.producers.engine_errors.EngineError` naming the worker URL. HTTP 4xx is
raised at once as :class:`EngineRequestError`. An aborted request is returned as a result
whose ``finish_type`` is ``"abort"`` — never as a finished one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from typing_extensions import Self

from strawq.config import Config
from strawq.producers.engine_errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from strawq.producers.sample import Sample, SampleError, SamplerParams, apply_segment
from strawq.producers.sglang_protocol import (
    GenerateResult,
    build_generate_payload,
    parse_generate_body,
    parse_version,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True, kw_only=True)
class ClientConfig(Config):
    """Client settings. Every wait has a deadline.

    Fields:
        connect_timeout_s: TCP connect timeout per attempt.
        generate_timeout_s: total time allowed for one ``/generate`` attempt.
        control_timeout_s: total time for one control call attempt (abort, loads, ...).
        weight_update_timeout_s: one ``/update_weights_from_disk`` attempt (it may wait
            for in-flight requests on an unpaused engine).
        max_retries: retries after the first attempt for retryable faults.
        backoff_base_s / backoff_max_s: exponential backoff bounds.
        jitter: fraction of random extra delay added to each backoff (0..1).
        pool_limit: maximum simultaneous connections of the pool.
        context_length: engine context length; resumes clamp their budget to it.
        default_version: map SGLang's non-numeric ``"default"`` version to this int
            (None: such a version is an error).
    """

    connect_timeout_s: float = 5.0
    generate_timeout_s: float = 600.0
    control_timeout_s: float = 30.0
    weight_update_timeout_s: float = 600.0
    max_retries: int = 3
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    jitter: float = 0.5
    pool_limit: int = 1024
    context_length: int | None = None
    default_version: int | None = None

    def validate(self) -> None:
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
        if self.pool_limit < 1:
            raise ValueError(f"ClientConfig.pool_limit must be >= 1, found {self.pool_limit}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(
                f"ClientConfig.context_length must be >= 2, found {self.context_length}"
            )


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


class _Retryable(Exception):
    def __init__(self, error: EngineError) -> None:
        super().__init__(str(error))
        self.error = error


class SGLangClient:
    """Async SGLang client. Use as ``async with SGLangClient([...]) as client:``."""

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
        self._session: aiohttp.ClientSession | None = None
        self._rng = random.Random()

    # -- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the session; in router mode also discover the workers."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.config.pool_limit, limit_per_host=0)
            self._session = aiohttp.ClientSession(connector=connector)
        if self.router_url is not None and not self._workers:
            await self.refresh_workers()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(
                "SGLangClient is not started; use 'async with SGLangClient(...)' or await start()"
            )
        return self._session

    @property
    def worker_urls(self) -> list[str]:
        return [w.url for w in self._workers]

    async def refresh_workers(self) -> list[WorkerInfo]:
        """Re-read the worker list from the router (no-op list without a router)."""
        if self.router_url is None:
            return list(self._workers)
        body = await self._call_json(
            "GET", self.router_url, "/workers", timeout_s=self.config.control_timeout_s
        )
        self._workers = parse_workers(body, url=self.router_url)
        logger.info("router %s lists %d workers", self.router_url, len(self._workers))
        return list(self._workers)

    # -- transport ----------------------------------------------------------------------
    def _backoff(self, attempt: int) -> float:
        base = min(self.config.backoff_max_s, self.config.backoff_base_s * (2**attempt))
        return base * (1.0 + self.config.jitter * self._rng.random())

    async def _with_retries(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        attempt = 0
        while True:
            try:
                return await op()
            except _Retryable as exc:
                if attempt >= self.config.max_retries:
                    raise exc.error from None
                delay = self._backoff(attempt)
                logger.warning(
                    "%s failed (%s); retry %d/%d in %.2fs",
                    what,
                    exc.error,
                    attempt + 1,
                    self.config.max_retries,
                    delay,
                )
                attempt += 1
                await asyncio.sleep(delay)

    async def _attempt(
        self,
        method: str,
        base: str,
        path: str,
        *,
        body: Any,
        params: Mapping[str, str] | None,
        timeout_s: float,
    ) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.config.connect_timeout_s)
        try:
            async with self.session.request(
                method, base + path, json=body, params=params, timeout=timeout
            ) as resp:
                data = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise _Retryable(
                EngineTimeout(f"{method} {path} timed out after {timeout_s:.1f}s", url=base)
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise _Retryable(
                EngineUnavailable(f"{method} {path}: cannot connect ({exc.os_error})", url=base)
            ) from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise _Retryable(
                EngineUnavailable(
                    f"{method} {path}: connection failed ({type(exc).__name__}: {exc})", url=base
                )
            ) from None
        if status >= 500:
            raise _Retryable(
                EngineUnavailable(f"{method} {path}: HTTP {status}: {_snippet(data)}", url=base)
            )
        if status >= 400:
            raise EngineRequestError(
                f"{method} {path} rejected: HTTP {status}: {_error_message(data)}",
                url=base,
                status=status,
            )
        return status, data

    async def _call_raw(
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
            return (
                await self._attempt(
                    method, base, path, body=body, params=params, timeout_s=timeout_s
                )
            )[1]

        return await self._with_retries(op, f"{method} {base}{path}")

    async def _call_json(
        self,
        method: str,
        base: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float,
    ) -> Any:
        data = await self._call_raw(method, base, path, body=body, params=params,
                                    timeout_s=timeout_s)
        return _decode_json(data, base, path)  # malformed JSON is not retried

    def _next_generate_url(self) -> str:
        if self.router_url is not None:
            return self.router_url
        url = self._workers[self._rr % len(self._workers)].url
        self._rr += 1
        return url

    # -- generation ---------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplerParams | Mapping[str, Any],
        *,
        rid: str | None = None,
        url: str | None = None,
        timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> GenerateResult:
        """One ``/generate`` call (n=1). Retries go to the next worker when ``url`` is None."""
        results = await self.generate_many(
            input_ids, sampling_params, rid=rid, url=url, timeout_s=timeout_s, extra=extra
        )
        if len(results) != 1:
            raise EngineProtocolError(
                f"expected one /generate result, found {len(results)}", url=results[0].url
            )
        return results[0]

    async def generate_many(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplerParams | Mapping[str, Any],
        *,
        rid: str | None = None,
        url: str | None = None,
        timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> list[GenerateResult]:
        """``/generate`` returning every result (a list for ``n>1``)."""
        if len(input_ids) == 0:
            raise ValueError("input_ids is empty; SGLang rejects empty input_ids")
        params = (
            sampling_params.to_sglang()
            if isinstance(sampling_params, SamplerParams)
            else dict(sampling_params)
        )
        payload = build_generate_payload(input_ids, params, rid=rid, extra=extra)
        timeout = timeout_s or self.config.generate_timeout_s
        attempts = 0

        async def op() -> list[GenerateResult]:
            nonlocal attempts
            if rid is not None and attempts:
                # A timed-out attempt may still run on the engine under the old rid: a retry
                # gets its own (the old rid is its prefix, so aborting the old rid's prefix
                # reaches both).
                payload["rid"] = f"{rid}.retry{attempts}"
            attempts += 1
            target = url or self._next_generate_url()
            _, data = await self._attempt(
                "POST", target, "/generate", body=payload, params=None, timeout_s=timeout
            )
            body = _decode_json(data, target, "/generate")
            try:
                return parse_generate_body(
                    body, url=target, default_version=self.config.default_version
                )
            except EngineProtocolError as exc:
                raise _Retryable(exc) from None

        return await self._with_retries(op, f"/generate rid={rid}")

    async def generate_sample(
        self,
        sample: Sample,
        *,
        rid: str | None = None,
        url: str | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult | None:
        """Run (or resume) ``sample`` for one segment and apply the result onto it.

        Sends prompt + generated ids with the remaining budget. With a zero budget the
        sample becomes TRUNCATED and no request is made (returns None). The result is
        checked against the budget before anything is appended.
        """
        if sample.is_final:
            raise SampleError(
                f"sample {sample.uid} is already {sample.status.value}; nothing to generate"
            )
        budget = sample.remaining_budget(self.config.context_length)
        if budget <= 0:
            sample.finish_without_request()
            return None
        result = await self.generate(
            sample.resume_input_ids(),
            sample.params.to_sglang(max_new_tokens=budget),
            rid=rid,
            url=url,
            timeout_s=timeout_s,
        )
        if len(result.output_ids) > budget:
            raise EngineProtocolError(
                f"engine returned {len(result.output_ids)} tokens for a budget of {budget} (rid {result.rid}); "
                "segment rejected",
                url=result.url,
            )
        apply_segment(sample, result.to_segment())
        return result

    # -- control, per worker --------------------------------------------------------------
    async def _each(self, url: str | None, fn: Callable[[str], Awaitable[T]]) -> dict[str, T]:
        urls = [url] if url is not None else self.worker_urls
        if not urls:
            raise EngineUnavailable("no workers known; refresh_workers() found none")
        values = await asyncio.gather(*(fn(u) for u in urls), return_exceptions=True)
        errors = [(u, v) for u, v in zip(urls, values, strict=True) if isinstance(v, Exception)]
        if errors:
            # every worker was tried; report each one that failed, by URL
            detail = "; ".join(f"{u}: {e}" for u, e in errors)
            first = errors[0][1]
            if isinstance(first, EngineError) and len(errors) == 1:
                raise first
            raise EngineUnavailable(f"{len(errors)} of {len(urls)} workers failed: {detail}",
                                    url=errors[0][0]) from first
        return dict(zip(urls, values, strict=True))  # type: ignore[arg-type]

    async def abort(
        self, rid: str | None = None, *, abort_all: bool = False, url: str | None = None
    ) -> None:
        """``/abort_request``: by rid prefix, or everything with ``abort_all``."""
        if rid is None and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid

        async def one(u: str) -> None:
            await self._call_raw(
                "POST", u, "/abort_request", body=body, timeout_s=self.config.control_timeout_s
            )

        await self._each(url, one)

    async def pause_generation(
        self, mode: str = "abort", *, url: str | None = None
    ) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, found {mode!r}")

        async def one(u: str) -> Any:
            return await self._call_json(
                "POST",
                u,
                "/pause_generation",
                body={"mode": mode},
                timeout_s=self.config.control_timeout_s,
            )

        return await self._each(url, one)

    async def continue_generation(self, *, url: str | None = None) -> dict[str, Any]:
        async def one(u: str) -> Any:
            return await self._call_json(
                "POST", u, "/continue_generation", body={}, timeout_s=self.config.control_timeout_s
            )

        return await self._each(url, one)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: int,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        url: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_disk`` on each worker; raises unless every one succeeds."""
        body = {
            "model_path": str(model_path),
            "weight_version": str(int(weight_version)),
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }

        async def one(u: str) -> Any:
            reply = await self._call_json(
                "POST",
                u,
                "/update_weights_from_disk",
                body=body,
                timeout_s=self.config.weight_update_timeout_s,
            )
            if not isinstance(reply, Mapping) or reply.get("success") is not True:
                raise EngineError(
                    f"update_weights_from_disk({model_path}) failed: {reply!r}", url=u
                )
            return reply

        return await self._each(url, one)

    async def update_weight_version(
        self, new_version: int, *, abort_all_requests: bool = True, url: str | None = None
    ) -> dict[str, Any]:
        body = {"new_version": str(int(new_version)), "abort_all_requests": abort_all_requests}

        async def one(u: str) -> Any:
            reply = await self._call_json(
                "POST",
                u,
                "/update_weight_version",
                body=body,
                timeout_s=self.config.control_timeout_s,
            )
            if not isinstance(reply, Mapping) or reply.get("success") is not True:
                raise EngineError(f"update_weight_version({new_version}) failed: {reply!r}", url=u)
            return reply

        return await self._each(url, one)

    async def flush_cache(
        self, *, url: str | None = None, deadline_s: float = 60.0, poll_s: float = 0.5
    ) -> None:
        """``/flush_cache``, retried while the engine answers 400 (busy) until ``deadline_s``."""

        async def one(u: str) -> None:
            deadline = time.monotonic() + deadline_s
            while True:
                try:
                    await self._call_raw(
                        "POST", u, "/flush_cache", timeout_s=self.config.control_timeout_s
                    )
                    return
                except EngineRequestError as exc:
                    if time.monotonic() + poll_s > deadline:
                        raise EngineTimeout(
                            f"flush_cache still refused after {deadline_s:.1f}s ({exc}); the engine is not idle — "
                            "pause it (mode abort/retract) or abort requests first",
                            url=u,
                        ) from None
                    await asyncio.sleep(poll_s)

        await self._each(url, one)

    async def loads(self, url: str) -> dict[str, Any]:
        body = await self._call_json(
            "GET",
            url,
            "/v1/loads",
            params={"include": "core"},
            timeout_s=self.config.control_timeout_s,
        )
        if not isinstance(body, Mapping) or not isinstance(body.get("loads"), list):
            raise EngineProtocolError(
                f"/v1/loads must return {{'loads': [...]}}, found {str(body)[:120]}", url=url
            )
        return dict(body)

    async def num_requests(self, url: str) -> int:
        """Running + waiting requests on one worker (0 = idle)."""
        body = await self.loads(url)
        try:
            return sum(
                int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                for x in body["loads"]
            )
        except (TypeError, ValueError, AttributeError):
            raise EngineProtocolError(
                f"/v1/loads entries are malformed: {body['loads']!r}", url=url
            ) from None

    async def model_info(self, url: str) -> dict[str, Any]:
        body = await self._call_json(
            "GET", url, "/model_info", timeout_s=self.config.control_timeout_s
        )
        if not isinstance(body, Mapping):
            raise EngineProtocolError(
                f"/model_info must return an object, found {str(body)[:120]}", url=url
            )
        return dict(body)

    async def weight_version(self, url: str) -> int:
        info = await self.model_info(url)
        return parse_version(
            info.get("weight_version"), url=url, default_version=self.config.default_version
        )

    async def health_generate(self, url: str, *, timeout_s: float | None = None) -> bool:
        """True when the worker answers ``/health_generate`` with 200 (no retries)."""
        try:
            await self._attempt(
                "GET",
                url,
                "/health_generate",
                body=None,
                params=None,
                timeout_s=timeout_s or self.config.control_timeout_s,
            )
            return True
        except (_Retryable, EngineRequestError):
            return False

    async def abort_until_idle(
        self, *, url: str | None = None, deadline_s: float = 60.0, poll_s: float = 0.5
    ) -> None:
        """Abort everything on each worker, repeating until it reports no requests (slime PR #2056)."""

        async def one(u: str) -> None:
            deadline = time.monotonic() + deadline_s
            while True:
                await self._call_raw(
                    "POST",
                    u,
                    "/abort_request",
                    body={"abort_all": True},
                    timeout_s=self.config.control_timeout_s,
                )
                if await self.num_requests(u) == 0:
                    return
                if time.monotonic() + poll_s > deadline:
                    raise EngineTimeout(
                        f"worker still busy {deadline_s:.1f}s after abort_all", url=u
                    )
                await asyncio.sleep(poll_s)

        await self._each(url, one)


def _snippet(data: bytes, limit: int = 200) -> str:
    return data[:limit].decode("utf-8", errors="replace")


def _error_message(data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return _snippet(data)
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
        if "message" in body:
            return str(body["message"])
    return _snippet(data)


def _decode_json(data: bytes, url: str, path: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise _Retryable(
            EngineProtocolError(f"{path} returned malformed JSON: {_snippet(data, 120)!r}", url=url)
        ) from None
