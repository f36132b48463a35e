"""What a producer needs from an engine client: the seam where engines are injected.

``strawq.producers.sglang_client.SGLangClient`` is the implementation for SGLang-protocol
engines (the real server and the local ones); tests may pass anything with this shape.
"""

from __future__ import annotations

from typing import Protocol

from strawq.producers.sample import Sample
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

    async def generate_sample(self, sample: Sample, *,
                              rid: str | None = None) -> GenerateResult | None:
        """Run or resume ``sample`` for one segment and apply it (None: nothing to send)."""
        ...

    async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
        """``/abort_request`` on ``url`` (or every worker) for the exact ``rid`` (SGLang
        0.5.23 ignores a rid that is not an exact live one, so never a prefix)."""
        ...
