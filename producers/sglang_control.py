"""The engines' control plane: abort, pause, continue, weight updates, loads, model info.

:class:`EngineControl` holds the control calls over a
:class:`~strawq.producers.engine_transport.Transport` and the list of worker URLs; the engine
client (``strawq.producers.sglang_client.SGLangClient``) owns both and is an
``EngineControl``, so the calls are the client's own (``client.push_weights(...)``). sglang-router
0.3.x does not route control calls, so every one of them goes to each worker URL directly
(``each``), and a failure names every worker that failed. The weight push
that works on SGLang 0.5.23 is :meth:`EngineControl.push_weights` (pause with abort, wait
until idle, update, continue): a bare ``update_weights_from_disk`` is refused while
requests run ("cache was not flushed").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from strawq.producers.engine_errors import (
    EngineAuthError,
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    WeightUpdateRefused,
)
from strawq.producers.engine_transport import ClientConfig, Transport
from strawq.producers.sglang_protocol import parse_version

logger = logging.getLogger(__name__)

T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")


class EngineControl:
    """Control calls to every worker (or one ``url``), over the client's transport.

    The engine client's own calls: :class:`~strawq.producers.sglang_client.SGLangClient`
    is an ``EngineControl`` (``client.push_weights(...)``), and supplies ``transport``,
    ``config`` and ``worker_urls``.
    """

    transport: Transport
    config: ClientConfig

    @property
    def worker_urls(self) -> list[str]:
        """Every worker's base URL: each control call goes to each one."""
        raise NotImplementedError

    async def each(self, url: str | None, fn: Callable[[str], Awaitable[T]]) -> dict[str, T]:
        """``fn(u)`` on ``url`` or on every worker at once; raises naming each that failed."""
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
            if all(isinstance(e, WeightUpdateRefused) for _, e in errors):
                raise WeightUpdateRefused(
                    f"{len(errors)} of {len(urls)} workers refused the weight update: {detail}",
                    url=errors[0][0],
                ) from first
            raise EngineUnavailable(f"{len(errors)} of {len(urls)} workers failed: {detail}",
                                    url=errors[0][0]) from first
        return dict(zip(urls, values, strict=True))  # type: ignore[arg-type]

    async def abort(
        self, rid: str | None = None, *, abort_all: bool = False, url: str | None = None
    ) -> None:
        """``/abort_request`` on every worker: one exact rid, or everything (``abort_all``).

        A rid prefix aborts nothing on SGLang 0.5.23; use :meth:`abort_rids` to abort a
        set of requests.
        """
        if rid is None and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid

        async def one(u: str) -> None:
            await self.transport.call_raw(
                "POST", u, "/abort_request", body=body, timeout_s=self.config.control_timeout_s
            )

        await self.each(url, one)

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
            await asyncio.gather(*(
                self.transport.call_raw("POST", u, "/abort_request",
                                        body={"rid": r, "abort_all": False},
                                        timeout_s=self.config.control_timeout_s)
                for r in rids))

        await self.each(url, one)

    async def pause_generation(
        self, mode: str = "abort", *, url: str | None = None
    ) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, found {mode!r}")

        async def one(u: str) -> Any:
            return await self.transport.call_json(
                "POST",
                u,
                "/pause_generation",
                body={"mode": mode},
                timeout_s=self.config.control_timeout_s,
            )

        return await self.each(url, one)

    async def continue_generation(self, *, url: str | None = None) -> dict[str, Any]:
        async def one(u: str) -> Any:
            return await self.transport.call_json(
                "POST", u, "/continue_generation", body={}, timeout_s=self.config.control_timeout_s
            )

        return await self.each(url, one)

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
            try:
                reply = await self.transport.call_json(
                    "POST",
                    u,
                    "/update_weights_from_disk",
                    body=body,
                    timeout_s=self.config.weight_update_timeout_s,
                )
            except EngineAuthError:
                raise
            except EngineRequestError as exc:
                raise WeightUpdateRefused(
                    f"update_weights_from_disk({model_path}, version {weight_version}) refused: "
                    f"{exc}. SGLang refuses while requests run on an in_place-paused engine; "
                    "push with push_weights() (pause mode abort -> update -> continue)",
                    url=u,
                    status=exc.status,
                ) from None
            if not isinstance(reply, Mapping) or reply.get("success") is not True:
                raise WeightUpdateRefused(
                    f"update_weights_from_disk({model_path}) failed: {reply!r}", url=u, reply=reply
                )
            return reply

        return await self.each(url, one)

    async def push_weights(
        self,
        model_path: str,
        *,
        weight_version: int,
        url: str | None = None,
        retries: int = 2,
        idle_deadline_s: float = 30.0,
    ) -> dict[str, Any]:
        """The trainer-side push that works on SGLang 0.5.23, on every worker.

        Per worker: ``pause_generation(abort)`` (in-flight requests come back aborted with
        their tokens; new ones wait at the engine's gate), wait until ``/v1/loads`` shows
        no request (an aborted request can linger in the scheduler for a step after its
        reply), ``update_weights_from_disk`` with the default cache flush, then
        ``continue_generation`` — also when the update failed, so that a refused push never
        leaves an engine paused. A "cache was not flushed" refusal (the weights are loaded,
        the label is not) is retried after waiting for idle again, ``retries`` times.
        Raises :class:`WeightUpdateRefused` naming the worker(s) that refused.
        """

        async def one(u: str) -> Any:
            await self.pause_generation("abort", url=u)
            try:
                for attempt in range(retries + 1):
                    await self._wait_idle(u, idle_deadline_s)
                    try:
                        replies = await self.update_weights_from_disk(
                            model_path, weight_version=weight_version, url=u
                        )
                        return replies[u]
                    except WeightUpdateRefused as exc:
                        if attempt == retries or "cache was not flushed" not in str(exc):
                            raise
                        logger.warning("push to %s refused (%s); retrying when idle", u, exc)
            finally:
                await self.continue_generation(url=u)
            raise AssertionError("unreachable")  # pragma: no cover

        return await self.each(url, one)

    async def _wait_idle(self, url: str, deadline_s: float, poll_s: float = 0.1) -> None:
        deadline = time.monotonic() + deadline_s
        while await self.num_requests(url) > 0:
            if time.monotonic() > deadline:
                logger.warning("%s still reports requests %.0fs after the pause", url, deadline_s)
                return
            await asyncio.sleep(poll_s)

    async def update_weight_version(
        self, new_version: int, *, abort_all_requests: bool = True, url: str | None = None
    ) -> dict[str, Any]:
        body = {"new_version": str(int(new_version)), "abort_all_requests": abort_all_requests}

        async def one(u: str) -> Any:
            reply = await self.transport.call_json(
                "POST",
                u,
                "/update_weight_version",
                body=body,
                timeout_s=self.config.control_timeout_s,
            )
            if not isinstance(reply, Mapping) or reply.get("success") is not True:
                raise EngineError(f"update_weight_version({new_version}) failed: {reply!r}", url=u)
            return reply

        return await self.each(url, one)

    async def flush_cache(
        self, *, url: str | None = None, deadline_s: float = 60.0, poll_s: float = 0.5
    ) -> None:
        """``/flush_cache``, retried while the engine answers 400 (busy) until ``deadline_s``."""

        async def one(u: str) -> None:
            deadline = time.monotonic() + deadline_s
            while True:
                try:
                    await self.transport.call_raw(
                        "POST", u, "/flush_cache", timeout_s=self.config.control_timeout_s
                    )
                    return
                except EngineAuthError:
                    raise
                except EngineRequestError as exc:
                    if time.monotonic() + poll_s > deadline:
                        raise EngineTimeout(
                            f"flush_cache still refused after {deadline_s:.1f}s ({exc}); the "
                            "engine is not idle — pause it (mode abort/retract) or abort "
                            "requests first",
                            url=u,
                        ) from None
                    await asyncio.sleep(poll_s)

        await self.each(url, one)

    async def loads(self, url: str) -> dict[str, Any]:
        body = await self.transport.call_json(
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
        body = await self.transport.call_json(
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

    async def abort_until_idle(
        self, *, url: str | None = None, deadline_s: float = 60.0, poll_s: float = 0.5
    ) -> None:
        """Abort everything on each worker, repeating until it reports no requests.

        (slime PR #2056's abort-until-idle.)
        """

        async def one(u: str) -> None:
            deadline = time.monotonic() + deadline_s
            while True:
                await self.transport.call_raw(
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

        await self.each(url, one)
