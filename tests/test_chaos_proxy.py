"""The chaos bench's counting proxy (``bench/chaos_proxy.py``) with a streamed reply: it is
passed on event by event as it arrives, and counted from its last ``data:`` chunk."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chaos_proxy import LastEvent, Proxies, Tally  # noqa: E402 (bench/)

RID = "p.r0/t7.g2/1.0"


def chunk(ids: list[int], finish: dict[str, Any] | None) -> bytes:
    body = {"output_ids": ids, "meta_info": {"id": RID, "completion_tokens": len(ids),
                                             "finish_reason": finish, "weight_version": "3"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_last_event_is_the_last_data_chunk_whatever_the_pieces() -> None:
    stream = (chunk([5, 6], None) + b": a comment\n\n" + chunk([5, 6, 7, 8], None)
              + chunk([5, 6, 7, 8, 9], {"type": "abort"}) + b"data: [DONE]\n\n")
    for size in (1, 7, len(stream)):
        last = LastEvent()
        for i in range(0, len(stream), size):
            last.feed(stream[i:i + size])
        assert last.last is not None
        assert json.loads(last.last)["output_ids"] == [5, 6, 7, 8, 9], size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_streamed_reply_passes_through_chunk_by_chunk_and_is_counted() -> None:
    """The client reads the first chunk while the engine still holds back the rest (a proxy
    that read the whole reply first would never hand it on: the engine waits for the
    client's go-ahead), then the aborted last chunk is counted with every token; each chunk
    is an output (with its ``weight_version``: no spans before the last)."""
    from aiohttp import web

    port = _free_port()
    go = threading.Event()
    loop = asyncio.new_event_loop()

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk([1, 2, 3], None))
        while not go.is_set():  # the client has read the first chunk
            await asyncio.sleep(0.01)
        await resp.write(chunk([1, 2, 3, 4, 5, 6], {"type": "abort"}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    tally = Tally()
    proxies = Proxies([port], tally)
    try:
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", proxies.ports[0], timeout=30)
        conn.request("POST", "/generate", json.dumps({"rid": RID, "input_ids": [9],
                                                      "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type", "").startswith(
            "text/event-stream")
        first = resp.readline() + resp.readline()
        assert json.loads(first[len(b"data: "):])["output_ids"] == [1, 2, 3]
        go.set()
        rest = resp.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        conn.close()
        for _ in range(500):  # the proxy counts once the stream ended on its side
            with tally.lock:
                if tally.answers:
                    break
            threading.Event().wait(0.01)
        with tally.lock:
            assert [(a[1], a[2], a[3], a[4]) for a in tally.answers] == [("p.r0", "t7", 2, 6)]
            assert tally.finishes == {RID: "abort"}
            # every chunk is an output a client may have kept; only the last is an answer
            assert [o[3] for o in tally.outputs] == [(1, 2, 3), (1, 2, 3, 4, 5, 6)]
            assert [o[4] for o in tally.outputs] == [(3,) * 3, (3,) * 6]
            assert [r[1] for r in tally.requests] == [RID]
    finally:
        proxies.close()
        loop.call_soon_threadsafe(loop.stop)
