"""What a producer needs from an engine client: the seam where engines are injected.

``strawq.producers.sglang_client.SGLangClient`` is the implementation for SGLang-protocol
engines (the real server and the local ones); anything with this shape may be injected
(``Producer(config, client=...)``). The client only speaks the protocol: one ``/generate``
segment in, one validated :class:`GenerateResult` out. What the reply means for a sample
(its budget, the reply checks, applying the tokens) is the producer's sample step
(``strawq.producers.sample_step``), and every client a producer uses is wrapped in its
weight-version guard (``strawq.producers.engine_versions.GuardedClient``), whatever its
type.

The optional engine calls are declared too, one protocol each, and a client may make any
of them (``SGLangClient`` makes all): :class:`VersionProbe` (``weight_version(url)``: the
guard probes engines with it), :class:`ModelInfoProbe` (``model_info(url)``: EOS ids at
start), :class:`RouterClient` (``router_url`` and ``refresh_workers()``: a router's worker
list). :func:`optional_calls` says which ones a client makes; for one it does not, the
declared behaviour is: no version probe (no engine is probed, the replies' own versions
are still judged), no EOS ids from the engine (the other sources are tried), no router
(the worker list is what it is).
"""

from __future__ import annotations

import inspect

from collections.abc import Callable, Mapping, MutableSet, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from strawq.producers.sglang_protocol import GenerateResult


class EngineClient(Protocol):
    """The engine calls a producer makes: lifecycle, one generation segment, abort."""

    @property
    def worker_urls(self) -> list[str]:
        """Every worker's base URL (aborts go to each one)."""
        ...

    async def start(self) -> None:
        """Open connections (idempotent); called by ``Producer.run``."""
        ...

    async def close(self) -> None:
        ...

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, among: Sequence[str] | None = None,
                       extra: Mapping[str, Any] | None = None,
                       live: MutableSet[str] | None = None,
                       on_chunk: Callable[[GenerateResult], None] | None = None
                       ) -> GenerateResult:
        """One ``/generate`` segment (n=1) under ``rid``, on one of ``among`` (None: any
        worker). Every wire rid the call sends (a retry's own rid included) is in ``live``
        while it is in flight, so that an abort can name it exactly. A client that streams
        passes each chunk before the last to ``on_chunk`` (the reply so far, shaped as an
        abort: ``GenerateResult.streaming``); one that does not never calls it. A fault
        after chunks with tokens arrived is raised, not retried from the old prefix."""
        ...

    async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
        """``/abort_request`` on ``url`` (or every worker) for the exact ``rid`` (SGLang
        0.5.23 ignores a rid that is not an exact live one, so never a prefix)."""
        ...


@runtime_checkable
class VersionProbe(Protocol):
    """Optional: reads an engine's weight version (``/model_info`` ``weight_version``)."""

    async def weight_version(self, url: str) -> int:
        ...


@runtime_checkable
class ModelInfoProbe(Protocol):
    """Optional: reads an engine's ``/model_info`` (the EOS ids a producer resolves)."""

    async def model_info(self, url: str) -> dict[str, Any]:
        ...


class EngineWorker(Protocol):
    """One worker as a router lists it."""

    @property
    def url(self) -> str:
        ...

    @property
    def is_healthy(self) -> bool:
        ...


@runtime_checkable
class RouterClient(Protocol):
    """Optional: a client behind a router, which can re-read the router's worker list."""

    @property
    def router_url(self) -> str | None:
        """The router's URL (None: the client talks to its workers directly)."""
        ...

    async def refresh_workers(self) -> Sequence[EngineWorker]:
        """Re-read the router's worker list (``worker_urls`` follows it)."""
        ...


@dataclass(frozen=True)
class OptionalCalls:
    """The optional calls one client makes: each is the client itself, or None when it
    does not make that call (the module docstring says what happens then)."""

    version: VersionProbe | None
    model: ModelInfoProbe | None
    router: RouterClient | None

    @property
    def router_url(self) -> str | None:
        """The router the client is behind (None: none, or no router calls)."""
        return None if self.router is None else self.router.router_url


def optional_calls(client: object) -> OptionalCalls:
    """Which of the optional engine calls ``client`` makes (any client, wrapped or not)."""
    return OptionalCalls(
        version=client if isinstance(client, VersionProbe) else None,
        model=client if isinstance(client, ModelInfoProbe) else None,
        router=client if isinstance(client, RouterClient) else None)


def takes_chunks(client: object) -> bool:
    """Whether ``client.generate`` takes ``on_chunk`` (a client written before streamed
    replies may not: it is called without it, and its segments are not held as they run)."""
    gen = getattr(client, "generate", None)
    if gen is None:
        return False
    try:
        params = inspect.signature(gen).parameters
    except (TypeError, ValueError):
        return False
    return "on_chunk" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                       for p in params.values())


async def warm_prefix(client: EngineClient, input_ids: Sequence[int], *,
                      rid: str) -> GenerateResult:
    """Prefill ``input_ids`` into an engine's radix cache and generate nothing
    (``max_new_tokens`` 0, as SGLang does itself before the copies of an ``n > 1`` request;
    ``GenerationConfig.warm_prefix``). ``rid``: one of the task's, so that ``cache_aware``
    routing sends it to the engine the task's samples go to."""
    return await client.generate(input_ids, {"max_new_tokens": 0}, rid=rid)
