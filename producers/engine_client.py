"""What a producer needs from an engine client: the seam where engines are injected.

``strawq.producers.sglang_client.SGLangClient`` is the implementation for SGLang-protocol
engines (the real server and the local ones); anything with this shape may be injected
(``Producer(config, client=...)``). The client only speaks the protocol: one ``/generate``
segment in, one validated :class:`GenerateResult` out. What the reply means for a sample
(its budget, the reply checks, applying the tokens) is the producer's sample step
(``strawq.producers.sample_step``), and every client a producer uses is wrapped in its
weight-version guard (``strawq.producers.engine_versions.GuardedClient``), whatever its
type.

Optional, looked up with ``getattr``: ``weight_version(url) -> int`` (the guard probes
engines with it; without it nothing is probed), ``model_info(url) -> dict`` (EOS ids at
start), ``router_url`` and ``refresh_workers()`` (a router's worker list).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableSet, Sequence
from typing import Any, Protocol

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
                       live: MutableSet[str] | None = None) -> GenerateResult:
        """One ``/generate`` segment (n=1) under ``rid``, on one of ``among`` (None: any
        worker). Every wire rid the call sends (a retry's own rid included) is in ``live``
        while it is in flight, so that an abort can name it exactly."""
        ...

    async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
        """``/abort_request`` on ``url`` (or every worker) for the exact ``rid`` (SGLang
        0.5.23 ignores a rid that is not an exact live one, so never a prefix)."""
        ...


async def warm_prefix(client: EngineClient, input_ids: Sequence[int], *,
                      rid: str) -> GenerateResult:
    """Prefill ``input_ids`` into an engine's radix cache and generate nothing
    (``max_new_tokens`` 0, as SGLang does itself before the copies of an ``n > 1`` request;
    ``ClientConfig.warm_prefix``). ``rid``: one of the task's, so that ``cache_aware``
    routing sends it to the engine the task's samples go to."""
    return await client.generate(input_ids, {"max_new_tokens": 0}, rid=rid)
