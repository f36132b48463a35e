"""The chaos benchmark's counting proxy: one forwarding proxy per engine, tallying the
completion tokens of every ``/generate`` answer by producer, task and lease generation
(parsed from the rid ``producer/task.gN/...``). A proxy stands where sglang-router would:
the request of a client that went away is aborted on its engine (see ``_abort``). A streamed
reply (``"stream": true``, ``text/event-stream``) is passed on event by event as it arrives
and counted from its last ``data:`` chunk (SGLang's chunks are cumulative: the last is the
whole reply; an aborted stream's last chunk carries every token so far: ``LastEvent``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from strawq.producers.engines.server import client_gone_first


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (time, producer, task id, gen, completion tokens, rid)
    answers: list[tuple[float, str, str, int, int, str]] = field(default_factory=list)
    #: every answer's output: (task id, sample index, gen, output token ids, the weight
    #: version of each output token as the engine stamped it, time), for the "invented" check
    outputs: list[tuple[str, int, int, tuple[int, ...], tuple[int, ...], float]] = field(
        default_factory=list)
    #: every ``/generate`` request as it arrived: (time, rid, the resumed prefix it declares
    #: in ``custom_params.strawq_resumed_tokens``), for the token RPO (chaos_longgen.py)
    requests: list[tuple[float, str, int]] = field(default_factory=list)
    #: each answered rid's finish reason type (``stop``, ``length``, ``abort``)
    finishes: dict[str, str] = field(default_factory=dict)


def streamed(body: bytes) -> bool:
    """Whether a ``/generate`` body asks for a streamed reply (``"stream": true``)."""
    try:
        rq = json.loads(body)
    except ValueError:
        return False
    return isinstance(rq, dict) and rq.get("stream") is True


def resumed_tokens(body: dict[str, Any]) -> int:
    """The resumed prefix a ``/generate`` body declares (0: a fresh sample)."""
    params = body.get("sampling_params")
    custom = params.get("custom_params") if isinstance(params, dict) else None
    try:
        return int(custom.get("strawq_resumed_tokens") or 0) if isinstance(custom, dict) else 0
    except (TypeError, ValueError):
        return 0


def sample_of_rid(rid: str) -> int | None:
    """The sample index of a rid ``producer/task.gN/<sample>.<request>``."""
    try:
        return int(rid.rsplit("/", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return None


def token_versions(meta: dict[str, Any], n: int) -> tuple[int, ...]:
    """Per output token, the weight version of ``meta_info.weight_versions`` (spans); a
    streamed chunk before the last has no spans: its ``weight_version`` for every token."""
    out = [-1] * n
    if not meta.get("weight_versions"):
        try:
            return (int(meta["weight_version"]),) * n
        except (KeyError, TypeError, ValueError):
            return tuple(out)
    for span in meta.get("weight_versions") or []:
        try:
            v, a, b = int(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            continue
        out[max(a, 0):min(b, n)] = [v] * (min(b, n) - max(a, 0))
    return tuple(out)


class LastEvent:
    """The newest ``data:`` payload of an SSE stream fed in arbitrary pieces (``[DONE]``
    and comments skipped): what a streamed reply is counted from."""

    def __init__(self) -> None:
        self.buf = b""
        #: the last complete ``data:`` event's JSON (None: none yet)
        self.last: bytes | None = None
        #: the ones before it (each a cumulative reply so far: what a client that was cut
        #: off, or journaled it, may have kept)
        self.earlier: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self.buf += data
        *events, self.buf = self.buf.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            payload = b"\n".join(line[5:].strip() for line in event.split(b"\n")
                                  if line.startswith(b"data:"))
            if payload and payload != b"[DONE]":
                if self.last is not None:
                    self.earlier.append(self.last)
                self.last = payload


def parse_rid(rid: str) -> tuple[str, str, int] | None:
    try:
        producer, lease, _rest = rid.split("/", 2)
        task, _, gen = lease.rpartition(".g")
        return producer, task, int(gen)
    except ValueError:
        return None


class Proxies:
    """One forwarding proxy per engine (aiohttp, on a thread of this process)."""

    def __init__(self, targets: list[int], tally: Tally, hosts: tuple[str, ...] = ()) -> None:
        self.targets = targets
        self.tally = tally
        #: addresses besides loopback to listen on, at the same port (the host ends of the
        #: producers' network namespaces: ``--fault-kinds partition``)
        self.hosts = hosts
        self.ports: list[int] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(30)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        for port in self.targets:
            app = web.Application(client_max_size=256 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handler(port))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            bound: int = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.ports.append(bound)
            for host in self.hosts:
                await web.TCPSite(runner, host, bound).start()

    def _handler(self, port: int) -> Any:
        from aiohttp import web

        async def forward(request: web.Request, body: bytes) -> tuple[bytes, int, str]:
            url = f"http://127.0.0.1:{port}{request.rel_url}"
            async with self.session.request(request.method, url, data=body,
                                            headers={"Content-Type": request.headers.get(
                                                "Content-Type", "application/json")}) as r:
                return (await r.read(), r.status,
                        r.headers.get("Content-Type", "application/json"))

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if request.path == "/generate":
                self._note_request(body)
                if streamed(body):
                    out: web.StreamResponse = await self._stream(request, port, body)
                    return out
            call = asyncio.ensure_future(forward(request, body))
            try:
                if request.path == "/generate" and await client_gone_first(request, call):
                    await self._abort(port, body)
                    # the answer still comes (aborted, with its tokens): counted below
                data, status, ctype = await call
            except Exception:  # noqa: BLE001 - the engine is dead: what a dead engine gives
                return web.Response(status=502, text="engine unreachable")
            if request.path == "/generate" and status == 200:
                self._count(body, data)
            return web.Response(status=status, body=data, content_type=ctype.split(";")[0])
        return handle

    async def _stream(self, request: Any, port: int, body: bytes) -> Any:
        """A streamed ``/generate``: each piece passed on as it comes; a client gone away
        gets its request aborted (the stream goes on to its aborted last chunk, counted)."""
        from aiohttp import web

        last = LastEvent()
        out: web.StreamResponse | None = None
        client_gone = False
        try:
            async with self.session.post(f"http://127.0.0.1:{port}/generate", data=body,
                                         headers={"Content-Type": "application/json"}) as r:
                if r.status != 200 or r.content_type != "text/event-stream":
                    data = await r.read()
                    if r.status == 200:
                        self._count(body, data)
                    return web.Response(status=r.status, body=data,
                                        content_type=r.content_type)
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                  "Cache-Control": "no-cache"})
                await out.prepare(request)
                async for piece in r.content.iter_any():
                    last.feed(piece)
                    if client_gone:
                        continue
                    try:
                        await out.write(piece)
                    except (ConnectionError, RuntimeError):
                        client_gone = True
                        await self._abort(port, body)
                if not client_gone:
                    await out.write_eof()
        except Exception:  # noqa: BLE001 - the engine died: the client sees the stream end
            if out is None:
                return web.Response(status=502, text="engine unreachable")
        for earlier in last.earlier:
            self._count(body, earlier, answer=False)
        if last.last is not None:
            self._count(body, last.last)
        return out

    async def _abort(self, port: int, body: bytes) -> None:
        """The client went away: what sglang-router and SGLang do between them (the router
        drops the upstream request, the engine's tokenizer manager notices within 4 s and
        aborts the rid), done here so the aborted answer's tokens are still counted."""
        try:
            rid = json.loads(body).get("rid")
        except ValueError:
            return
        if isinstance(rid, str):
            async with self.session.post(f"http://127.0.0.1:{port}/abort_request",
                                         json={"rid": rid}) as r:
                await r.read()

    def _note_request(self, req: bytes) -> None:
        try:
            rq = json.loads(req)
        except ValueError:
            return
        if not isinstance(rq, dict) or not isinstance(rq.get("rid"), str):
            return
        with self.tally.lock:
            self.tally.requests.append((time.time(), rq["rid"], resumed_tokens(rq)))

    def _count(self, req: bytes, resp: bytes, *, answer: bool = True) -> None:
        """Tally one reply (``answer`` False: a streamed chunk before the last, kept among
        the outputs only: a client may resume from any chunk it received)."""
        try:
            rq, rs = json.loads(req), json.loads(resp)
        except ValueError:
            return
        rids = rq.get("rid")
        outs = rs if isinstance(rs, list) else [rs]
        rids = rids if isinstance(rids, list) else [rids] * len(outs)
        now = time.time()
        with self.tally.lock:
            for rid, out in zip(rids, outs, strict=False):
                who = parse_rid(str(rid))
                meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
                n = int(meta.get("completion_tokens") or 0)
                finish = meta.get("finish_reason")
                if isinstance(finish, dict) and who is not None and answer:
                    self.tally.finishes[str(rid)] = str(finish.get("type"))
                if who is not None and n and answer:
                    self.tally.answers.append((now, who[0], who[1], who[2], n, str(rid)))
                ids = out.get("output_ids") if isinstance(out, dict) else None
                i = sample_of_rid(str(rid))
                if who is not None and i is not None and isinstance(ids, list) and ids:
                    self.tally.outputs.append((who[1], i, who[2], tuple(int(t) for t in ids),
                                               token_versions(meta, len(ids)), now))

    def close(self) -> None:
        async def stop() -> None:
            await self.session.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
