"""The engine contract, streamed generation: ``/generate`` with ``"stream": true``.

One area of ``strawq.testing.engine_contract.EngineContract``; the facts are SGLang 0.5.23's
(server defaults: no ``--incremental-streaming-output``, ``stream_interval`` 1):

* SSE framing: ``Content-Type: text/event-stream``, one ``data: {json}`` event per chunk,
  blank-line separated, then ``data: [DONE]``;
* chunks are cumulative: each is the whole reply so far (``output_ids``,
  ``meta_info.output_token_logprobs``, ``completion_tokens``), ``finish_reason`` null
  before the last; the per-token ``weight_versions`` spans come with the last chunk only;
* the last chunk is the reply a request without ``stream`` gets;
* ``sampling_params.stream_interval`` k: the first token at once, then a chunk each k;
* an exact-rid abort mid-stream ends it with an ``abort`` chunk ("Aborted") holding every
  token so far, then ``[DONE]``;
* a client that closes the stream has its request aborted.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import numpy as np

from strawq.producers.sglang_protocol import GenerateResult
from strawq.testing.engine_target import (GREEDY, ContractPlumbing, EngineTarget, counts,
                                          until)


class StreamContract(ContractPlumbing):
    """What a streamed ``/generate`` carries, chunk by chunk."""

    async def _stream(self, t: EngineTarget, body: dict[str, Any], *,
                      after: int | None = None, then: Any = None
                      ) -> tuple[str, list[str]]:
        """POST a streamed body; returns the content type and the ``data:`` payloads.
        ``then`` (a coroutine function) runs once ``after`` chunks arrived; a ``then``
        of None with ``after`` set closes the stream there."""
        events: list[str] = []
        url = (t.router_url or t.url) + "/generate"
        async with aiohttp.ClientSession() as s, s.post(
                url, json={"stream": True, "return_logprob": True, **body},
                headers=t.headers()) as r:
            assert r.status == 200, await r.text()
            ctype = r.headers.get("Content-Type", "")
            async for line in r.content:
                text = line.decode()
                if not text.strip():
                    continue
                assert text.startswith("data: "), text
                events.append(text[len("data: "):].strip())
                if after is not None and len(events) == after:
                    if then is None:
                        break
                    await then()
        return ctype, events

    def test_stream_chunks_are_cumulative_sse(self, target: EngineTarget) -> None:
        async def go() -> None:
            sp = {**GREEDY, "max_new_tokens": 4}
            ctype, events = await self._stream(
                target, {"input_ids": list(target.prompt), "sampling_params": sp})
            assert ctype.startswith("text/event-stream")
            assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
            chunks = [json.loads(e) for e in events[:-1]]
            assert len(chunks) >= 2
            prev: list[int] = []
            for c in chunks[:-1]:  # before the last: null finish, no spans, cumulative
                m = c["meta_info"]
                assert m["finish_reason"] is None and "weight_versions" not in m
                ids = c["output_ids"]
                assert ids[:len(prev)] == prev and len(ids) > len(prev)
                assert len(m["output_token_logprobs"]) == len(ids) == m["completion_tokens"]
                assert [x[1] for x in m["output_token_logprobs"]] == ids
                prev = ids
            assert len(chunks[0]["output_ids"]) == 1  # the first token at once
            last = chunks[-1]["meta_info"]
            assert last["finish_reason"] == {"type": "length", "length": 4}
            assert chunks[-1]["output_ids"][:len(prev)] == prev
            assert [s["end"] - s["start"] for s in last["weight_versions"]] == [4]
            # the last chunk is the unstreamed reply (greedy), log-probs to the chunk's
            async with target.client() as c:
                whole = await c.generate(target.prompt, sp)
                assert whole.output_ids.tolist() == chunks[-1]["output_ids"]
                streamed = [x[0] for x in last["output_token_logprobs"]]
                assert np.allclose(whole.logprobs, streamed, atol=1e-2)
                held: list[GenerateResult] = []
                async with target.client(stream=True, stream_interval=1) as sc:
                    r = await sc.generate(target.prompt, sp, on_chunk=held.append)
                assert r.output_ids.tolist() == whole.output_ids.tolist()
                assert r.finish_reason == whole.finish_reason and not r.streaming
                assert [len(h.output_ids) for h in held] == list(range(1, len(held) + 1))
                assert all(h.is_abort and h.streaming for h in held)

        self.run(target, go())

    def test_stream_interval_spaces_the_chunks(self, target: EngineTarget) -> None:
        async def go() -> None:
            sp = {**GREEDY, "max_new_tokens": 7, "stream_interval": 3}
            _, events = await self._stream(
                target, {"input_ids": list(target.prompt), "sampling_params": sp})
            chunks = [json.loads(e) for e in events[:-1]]
            sizes = [len(c["output_ids"]) for c in chunks]
            finished = [c["meta_info"]["finish_reason"] is not None for c in chunks]
            assert finished == [False] * (len(chunks) - 1) + [True]  # one last chunk
            assert sizes[0] == 1 and sizes[-1] == 7
            steps = np.diff(sizes[:-1])
            assert (steps >= 3).all(), sizes  # a chunk each 3 tokens at least

        self.run(target, go())

    def test_abort_mid_stream_ends_it_with_the_tokens(self, target: EngineTarget) -> None:
        async def go() -> None:
            rid = "cts-abort"
            async with target.client() as c:
                async def abort() -> None:
                    await c.abort_rids([rid])

                _, events = await self._stream(target, {
                    "input_ids": list(target.prompt), "rid": rid,
                    "sampling_params": self._long(target)}, after=2, then=abort)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            last = chunks[-1]
            assert last["meta_info"]["finish_reason"]["type"] == "abort"
            assert last["meta_info"]["finish_reason"]["message"] == "Aborted"
            n = len(last["output_ids"])
            assert len(chunks[-2]["output_ids"]) <= n < target.long_tokens
            assert len(last["meta_info"]["output_token_logprobs"]) == n
            assert sum(s["end"] - s["start"] for s in last["meta_info"]["weight_versions"]) == n

        self.run(target, go())

    def test_closing_the_stream_aborts_the_request(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                await self._idle(c, target)
                _, events = await self._stream(target, {
                    "input_ids": list(target.prompt), "rid": "cts-close",
                    "sampling_params": self._long(target)}, after=2)
                assert len(events) == 2

                async def idle() -> bool:
                    return await counts(c, target.url) == (0, 0)

                try:
                    await until(idle, target.disconnect_deadline_s,
                                "the request of a closed stream aborted")
                finally:
                    if not await idle():
                        await c.abort_rids(["cts-close"])

        self.run(target, go())
