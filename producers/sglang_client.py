"""Async client for SGLang 0.5.x engines (and strawq's local engines), native HTTP protocol.

One :class:`SGLangClient` per process owns one ``aiohttp.ClientSession`` (one connection
pool). ``/generate`` goes to the router when one is configured, otherwise round-robin over
the worker list; control calls (abort, pause, weight updates, …) always go to each worker
directly, because sglang-router 0.3.x does not route them (docs/engines.md).

Faults (refused connections, resets, timeouts, HTTP 5xx, malformed JSON or shapes) are
retried a bounded number of times with exponential backoff and jitter, then raised as a
typed :class:`~strawq.producers.engine_errors.EngineError` naming the worker URL. HTTP 4xx is
raised at once as :class:`EngineRequestError` (401/403: :class:`EngineAuthError`). Nothing
else escapes: a caller that catches ``EngineError`` catches every engine failure.

Aborts are by **exact rid** (SGLang 0.5.23 ignores a rid prefix: docs/engines.md).
The client gives every request a rid and keeps the set of rids in flight, so that
:meth:`SGLangClient.abort_matching` can abort "everything of this producer / group" by
sending each live rid exactly, to every worker. An aborted reply whose last token is a
stop token (EOS unless ``ignore_eos``, or a ``stop_token_ids`` entry) is reported as
finished (``{"type": "stop", ..., "aborted": true}``): the real scheduler applies a pending
abort before its stop check, so such a reply did reach its end.

Authentication (SGLang ``--api-key`` / ``--admin-api-key``): the API key is sent as
``Authorization: Bearer`` on every call; the control endpoints that SGLang marks
admin-optional (abort, pause, continue, weight updates, flush) get the admin key when one
is configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from pathlib import Path
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from typing_extensions import Self

from strawq.config import Config
from strawq.producers.engine_errors import (
    EngineAuthError,
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from strawq.producers.engine_versions import VersionGuard
from strawq.producers.extras_protocol import extras_payload, segment_for
from strawq.producers.sample import Sample, SampleError, SamplerParams, apply_segment
from strawq.producers.sglang_control import ControlCalls
from strawq.producers.sglang_protocol import (
    GenerateResult,
    build_generate_payload,
    finalize_abort_at_stop,
    parse_generate_body,
    resumed_tokens,
    with_resumed_tokens,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Endpoints SGLang 0.5.23 marks ADMIN_OPTIONAL: with --admin-api-key they need that key.
ADMIN_PATHS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weight_version",
    "/flush_cache"})


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
        api_key: SGLang ``--api-key``; sent as a bearer token on every call.
        admin_api_key: SGLang ``--admin-api-key``; sent instead on the admin endpoints
            (abort, pause, continue, weight updates, flush).
        eos_token_ids: the model's EOS ids; None = read them from ``/model_info``
            (``eos_token_id``) or from the model's ``generation_config.json`` /
            ``config.json`` when the engine's ``model_path`` is readable here.
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
    api_key: str | None = None
    admin_api_key: str | None = None
    eos_token_ids: tuple[int, ...] | None = None

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
    """Internal: a fault worth retrying. Never leaves :class:`SGLangClient`."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Inflight:
    """One ``/generate`` call in flight: the caller's rid and the worker it went to."""

    logical_rid: str
    url: str


class SGLangClient(ControlCalls):
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
        self._inflight: dict[str, _Inflight] = {}
        self._eos: dict[str, frozenset[int]] = {}
        #: the producer's weight-version guard: skips stale engines, judges each reply
        self.guard: VersionGuard | None = None

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
        base = min(self.config.backoff_max_s, self.config.backoff_base_s * (2.0**attempt))
        return float(base * (1.0 + self.config.jitter * self._rng.random()))

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

    def _auth_headers(self, path: str) -> dict[str, str] | None:
        key = self.config.api_key
        if path in ADMIN_PATHS and self.config.admin_api_key:
            key = self.config.admin_api_key
        return None if key is None else {"Authorization": f"Bearer {key}"}

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
                method,
                base + path,
                json=body,
                params=params,
                timeout=timeout,
                headers=self._auth_headers(path),
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
        data = await self._call_raw(
            method, base, path, body=body, params=params, timeout_s=timeout_s
        )
        try:
            return _decode_json(data, base, path)
        except _Retryable as exc:  # malformed JSON is not retried, and never escapes
            raise exc.error from None

    def _next_generate_url(self) -> str:
        urls = self.worker_urls if self.guard is None else self.guard.usable(self.worker_urls)
        if self.router_url is not None:
            return self.router_url
        url = urls[self._rr % len(urls)]
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
        """``/generate`` returning every result; ``n>1`` becomes n abortable requests.

        SGLang 0.5.23 gives the sub-requests of an ``n>1`` call random rids, so none of
        them could be aborted alone; the client sends n requests with rids
        ``{rid}#{i}.`` instead (no sub-rid is a prefix of another) and returns the n
        results in order.
        """
        if len(input_ids) == 0:
            raise ValueError("input_ids is empty; SGLang rejects empty input_ids")
        params = (
            sampling_params.to_sglang()
            if isinstance(sampling_params, SamplerParams)
            else dict(sampling_params)
        )
        n = params.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"sampling_params.n must be an int >= 1, found {n!r}")
        base = rid if rid is not None else uuid.uuid4().hex
        if n == 1:
            return [await self._generate_one(input_ids, params, base, url, timeout_s, extra)]
        single = {k: v for k, v in params.items() if k != "n"}
        seed = single.get("sampling_seed")
        calls = []
        for i in range(n):
            sub = dict(single)
            if isinstance(seed, int) and not isinstance(seed, bool):
                sub["sampling_seed"] = seed + i
            calls.append(self._generate_one(input_ids, sub, f"{base}#{i}.", url, timeout_s, extra))
        return list(await asyncio.gather(*calls))

    async def _generate_one(
        self,
        input_ids: Sequence[int],
        params: dict[str, Any],
        rid: str,
        url: str | None,
        timeout_s: float | None,
        extra: Mapping[str, Any] | None,
    ) -> GenerateResult:
        payload = build_generate_payload(input_ids, params, rid=rid, extra=extra)
        timeout = timeout_s or self.config.generate_timeout_s
        attempts = 0

        async def op() -> GenerateResult:
            nonlocal attempts
            if attempts:
                # A timed-out attempt may still run on the engine under the old rid: the
                # retry gets its own rid, and both stay tracked until they end.
                payload["rid"] = f"{rid}~retry{attempts}"
            attempts += 1
            target = url or self._next_generate_url()
            wire_rid = str(payload["rid"])
            self._inflight[wire_rid] = _Inflight(logical_rid=rid, url=target)
            try:
                _, data = await self._attempt(
                    "POST", target, "/generate", body=payload, params=None, timeout_s=timeout
                )
            finally:
                self._inflight.pop(wire_rid, None)
            body = _decode_json(data, target, "/generate")
            try:
                results = parse_generate_body(
                    body, url=target, default_version=self.config.default_version
                )
            except EngineProtocolError as exc:
                raise _Retryable(exc) from None
            if len(results) != 1:
                raise _Retryable(
                    EngineProtocolError(
                        f"expected one /generate result for rid {wire_rid}, found {len(results)}",
                        url=target,
                    )
                )
            return results[0]

        result = await self._with_retries(op, f"/generate rid={rid}")
        if result.is_abort and len(result.output_ids) and not params.get("ignore_eos"):
            # (ignore_eos switches off every token-based stop on SGLang 0.5.23)
            result = finalize_abort_at_stop(
                result,
                eos_ids=await self.eos_token_ids(result.url),
                stop_token_ids=params.get("stop_token_ids") or (),
                min_new_tokens=int(params.get("min_new_tokens") or 0),
            )
        return result

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

    async def abort_rids(self, rids: Sequence[str], *, url: str | None = None) -> None:
        """``/abort_request`` for each exact rid, on every worker (or ``url``).

        SGLang aborts only an exact live rid; an unknown rid is a harmless no-op, so each
        rid goes to each worker (behind a router the client does not know which one runs
        it). Raises :class:`EngineError` naming the workers that failed.
        """
        if not rids:
            return
        if any(not r for r in rids):
            raise ValueError("abort_rids needs non-empty rids (an empty rid aborts nothing)")

        async def one(u: str) -> None:
            await asyncio.gather(
                *(
                    self._call_raw(
                        "POST",
                        u,
                        "/abort_request",
                        body={"rid": r, "abort_all": False},
                        timeout_s=self.config.control_timeout_s,
                    )
                    for r in rids
                )
            )

        await self._each(url, one)

    async def eos_token_ids(self, url: str | None = None) -> frozenset[int]:
        """The model's EOS ids: the config's, else ``/model_info`` / the model's config files.

        Cached per worker. Empty when they cannot be found (then an aborted reply ending on
        EOS stays resumable; a warning says so once).
        """
        if self.config.eos_token_ids is not None:
            return frozenset(self.config.eos_token_ids)
        target = url if url is not None and url != self.router_url else None
        if target is None:
            target = self.worker_urls[0] if self.worker_urls else None
        if target is None:
            return frozenset()
        cached = self._eos.get(target)
        if cached is not None:
            return cached
        try:
            info = await self.model_info(target)
        except EngineError as exc:
            logger.warning("cannot read /model_info of %s for its EOS ids: %s", target, exc)
            return frozenset()
        found = eos_ids_from_model_info(info)
        if not found:
            logger.warning(
                "worker %s: no EOS id in /model_info nor in a readable model config; an aborted "
                "reply ending on EOS will be treated as resumable (set ClientConfig.eos_token_ids)",
                target,
            )
        self._eos[target] = found
        return found

    async def generate_sample(
        self,
        sample: Sample,
        *,
        rid: str | None = None,
        url: str | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult | None:
        """Run (or resume) ``sample`` for one segment and apply the result onto it.

        Sends prompt + generated ids with the remaining budget, and how many of them are
        the resumed prefix (``custom_params``, which SGLang ignores). With a zero budget the
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
            with_resumed_tokens(
                sample.params.to_sglang(max_new_tokens=budget), resumed_tokens(sample)
            ),
            rid=rid,
            url=url,
            timeout_s=timeout_s,
            extra=extras_payload(sample) or None,
        )
        if len(result.output_ids) > budget:
            raise EngineProtocolError(
                f"engine returned {len(result.output_ids)} tokens for a budget of {budget} "
                f"(rid {result.rid}); segment rejected",
                url=result.url,
            )
        if self.guard is not None:  # raises StaleEngine: no token from the wrong weights
            await self.guard.check(result)
        apply_segment(sample, segment_for(result, sample))
        return result

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


def eos_ids_from_model_info(info: Mapping[str, Any]) -> frozenset[int]:
    """EOS ids from ``/model_info``: its ``eos_token_id`` (strawq's local engines), else the
    model's ``generation_config.json`` / ``config.json`` when ``model_path`` (or
    ``tokenizer_path``) is a directory readable from here (SGLang 0.5.23 does not report
    them)."""
    found = _as_ids(info.get("eos_token_id"))
    if found:
        return found
    for key in ("model_path", "tokenizer_path"):
        path = info.get(key)
        if not isinstance(path, str) or not path:
            continue
        for name in ("generation_config.json", "config.json"):
            try:
                config = json.loads((Path(path) / name).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(config, Mapping):
                found = _as_ids(config.get("eos_token_id"))
                if found:
                    return found
    return frozenset()


def _as_ids(value: Any) -> frozenset[int]:
    if isinstance(value, bool):
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return frozenset(value)
    return frozenset()


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
