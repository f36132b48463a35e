"""Streamed generation: the chunk reader, the sample step holding what arrived
(``Sample.streamed``), and an engine killed mid-segment costing only what was not received.

The engine contract's stream area (``strawq.testing.engine_contract_stream``) states what
SGLang 0.5.23 streams; here is what strawq does with it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest

from strawq.ondisk.names import TaskName
from strawq.producers.engine_errors import (EngineProtocolError, EngineRequestError,
                                            EngineUnavailable)
from strawq.producers.engine_turn import EngineTurns
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread, start_engine_subprocess
from strawq.producers.group import GroupRun
from strawq.producers.held import ActiveGroup
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.producer_config import EngineConfig
from strawq.producers.sample import Sample, SamplerParams, SampleStatus, received
from strawq.producers.sample_step import step_sample
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sglang_protocol import STREAMED_SO_FAR, StreamReader
from strawq.tasks.claims import Lease

pytestmark = pytest.mark.timeout(120)


# -- the chunk reader ------------------------------------------------------------------------
def _chunk(ids: list[int], *, finish: Any = None, version: str = "0",
           spans: list[dict[str, Any]] | None = None) -> str:
    meta: dict[str, Any] = {
        "id": "r", "finish_reason": finish, "prompt_tokens": 3, "weight_version": version,
        "completion_tokens": len(ids),
        "output_token_logprobs": [[-0.5 - 0.01 * t, t, None] for t in ids]}
    if spans is not None:
        meta["weight_versions"] = spans
    return "data: " + json.dumps({"text": "", "output_ids": ids, "meta_info": meta})


def test_reader_takes_cumulative_chunks_and_the_last_is_the_reply() -> None:
    r = StreamReader(url="http://e")
    a = r.feed(_chunk([5]).encode())
    assert r.feed(b"\n") is None and r.feed(b": comment\n") is None
    b = r.feed(_chunk([5, 6, 7]))
    assert a is not None and b is not None
    assert a.streaming and a.finish_reason == STREAMED_SO_FAR and a.is_abort
    assert b.output_ids.tolist() == [5, 6, 7] and r.holdable(b)
    last = r.feed(_chunk([5, 6, 7, 8], finish={"type": "length", "length": 4},
                         spans=[{"version": "0", "start": 0, "end": 4}]))
    assert last is not None and not last.streaming and not r.holdable(last)
    r.feed("data: [DONE]\n")
    assert r.result() is last and r.done


def test_reader_refuses_incremental_chunks_with_what_to_do() -> None:
    r = StreamReader()
    r.feed(_chunk([5, 6]))
    with pytest.raises(EngineProtocolError, match="incremental-streaming-output"):
        r.feed(_chunk([7]))


def test_reader_raises_the_error_event_and_a_stream_cut_before_its_last_chunk() -> None:
    r = StreamReader()
    with pytest.raises(EngineRequestError, match="bad things"):
        r.feed('data: {"error": {"message": "bad things", "code": 400}}')
    cut = StreamReader()
    cut.feed(_chunk([5, 6]))
    with pytest.raises(EngineUnavailable, match="2 tokens received"):
        cut.result()
    assert cut.last is not None and cut.last.output_ids.tolist() == [5, 6]
    with pytest.raises(EngineProtocolError, match="not JSON"):
        StreamReader().feed("data: {oops")


def test_reader_stamps_new_tokens_with_the_chunk_version_and_distrusts_a_change() -> None:
    r = StreamReader()
    r.feed(_chunk([5, 6], version="3"))
    b = r.feed(_chunk([5, 6, 7], version="3"))
    assert b is not None and b.versions.tolist() == [3, 3, 3] and r.holdable(b)
    c = r.feed(_chunk([5, 6, 7, 8], version="4"))
    # the spans come with the last chunk only: which tokens are of 4 is unknown till then
    assert c is not None and not r.holdable(c)
    assert c.versions.tolist()[:3] == [3, 3, 3]
    last = r.feed(_chunk([5, 6, 7, 8], finish={"type": "length", "length": 4}, version="4",
                         spans=[{"version": "3", "start": 0, "end": 3},
                                {"version": "4", "start": 3, "end": 4}]))
    assert last is not None and last.versions.tolist() == [3, 3, 3, 4]


# -- the sample step over a streaming client -------------------------------------------------
@pytest.fixture(scope="module")
def sim_engine() -> Iterator[str]:
    sim = SimConfig(step_base_ms=2.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)
    with EngineThread(EngineOptions(kind="sim", max_running=4, sim=sim)) as engine:
        yield engine.url


class _Spy:
    """A client that notes, after each chunk reaches the step, what the sample holds."""

    def __init__(self, inner: SGLangClient, sample: Sample) -> None:
        self.inner, self.sample = inner, sample
        self.held: list[tuple[int, str]] = []

    @property
    def worker_urls(self) -> list[str]:
        return self.inner.worker_urls

    async def generate(self, *args: Any, on_chunk: Any = None, **kw: Any) -> Any:
        def spy(chunk: Any) -> None:
            on_chunk(chunk)
            seg = self.sample.streamed
            assert seg is not None
            self.held.append((received(self.sample).response_length,
                              str(seg.finish_reason["type"])))
        return await self.inner.generate(*args, on_chunk=spy, **kw)


def test_streamed_segment_is_held_while_it_runs_and_applied_as_unstreamed(
        sim_engine: str) -> None:
    params = SamplerParams(max_new_tokens=40, ignore_eos=True, seed=11, temperature=1.0)

    async def run(stream: bool) -> tuple[Sample, list[tuple[int, str]]]:
        s = Sample.new("t.0", [11, 22, 33], params)
        s.response_ids = np.array([7, 8], np.int32)  # resumed after an abort: a prefix held
        s.logprobs = np.array([-0.1, -0.2], np.float32)
        s.versions = np.zeros(2, np.int64)
        s.loss_mask = np.ones(2, np.uint8)
        s.status = SampleStatus.ABORTED
        cfg = ClientConfig(stream=stream, stream_interval=4, max_retries=0)
        async with SGLangClient([sim_engine], config=cfg) as c:
            spy = _Spy(c, s)
            res = await step_sample(spy, s, rid="t/t.g0/0.1")
        assert res is not None and s.streamed is None
        return s, spy.held

    streamed, held = asyncio.run(run(True))
    plain, none = asyncio.run(run(False))
    assert none == []  # an unstreamed client never calls on_chunk
    for name in ("response_ids", "logprobs", "versions", "loss_mask"):
        assert getattr(streamed, name).tolist() == getattr(plain, name).tolist(), name
    assert streamed.status is plain.status is SampleStatus.TRUNCATED
    assert streamed.finish_reason == plain.finish_reason
    assert streamed.num_segments == plain.num_segments == 1
    lengths = [n for n, _ in held]
    assert lengths[0] == 3 and lengths == sorted(lengths) and lengths[-1] < 42
    assert all(n2 - n1 >= 4 for n1, n2 in zip(lengths[1:], lengths[2:], strict=False))
    assert {kind for _, kind in held} == {"abort"}


def test_the_local_router_passes_a_stream_on_chunk_by_chunk(sim_engine: str) -> None:
    """A chunk reaches the client through the router while its request still runs on the
    worker (a router that waited for the whole reply would hand none before the end)."""
    with EngineThread(EngineOptions(kind="router", worker_urls=(sim_engine,))) as router:
        async def go() -> tuple[list[int], int, Any]:
            held: list[int] = []
            cfg = ClientConfig(stream=True, stream_interval=5, max_retries=0)
            async with SGLangClient([], router_url=router.url, config=cfg) as c, \
                    aiohttp.ClientSession() as http:
                task = asyncio.create_task(c.generate(
                    [11, 22], {"max_new_tokens": 3000, "ignore_eos": True}, rid="rt-1",
                    on_chunk=lambda ch: held.append(len(ch.output_ids))))
                while not held and not task.done():
                    await asyncio.sleep(0.01)
                running = len((await _live(http, sim_engine))["requests"])
                await c.abort_rids(["rt-1"], url=sim_engine)
                return held, running, await task

        held, running, r = asyncio.run(go())
    assert held and held[0] == 1 and running == 1
    assert r.is_abort and len(r.output_ids) >= held[-1]


def test_a_step_cancelled_mid_stream_keeps_what_arrived(sim_engine: str) -> None:
    async def go() -> Sample:
        s = Sample.new("c.0", [11, 22, 33], SamplerParams(max_new_tokens=5000,
                                                          ignore_eos=True, seed=5))
        cfg = ClientConfig(stream=True, stream_interval=4, max_retries=0)
        async with SGLangClient([sim_engine], config=cfg) as c:
            task = asyncio.create_task(step_sample(c, s, rid="c/c.g0/0.1"))
            while s.streamed is None or len(s.streamed.token_ids) < 20:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await c.abort_rids(["c/c.g0/0.1"])
        return s

    s = asyncio.run(go())
    assert s.status is SampleStatus.ABORTED and s.streamed is None
    assert s.response_length >= 20 and s.num_segments == 1
    assert len(s.logprobs) == len(s.versions) == s.response_length


# -- an engine killed mid-segment -----------------------------------------------------------
async def _live(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/strawq/live_requests") as r:
        body: dict[str, Any] = await r.json()
        return body


def _turns(client: SGLangClient, cfg: ClientConfig) -> tuple[EngineTurns, ActiveGroup]:
    name = TaskName(key="k", id="t1", gen=0, attempts=0, producer="p")
    lease = Lease(name=name, task={})
    run = GroupRun.fresh(lease, [11, 22, 33], [SamplerParams(max_new_tokens=400,
                                                             ignore_eos=True, seed=3)])
    halts: Any = SimpleNamespace(aborter=SimpleNamespace(abort_soon=lambda rid: None),
                                 stop_samples=lambda a, keep: None)
    engine = EngineConfig(workers=tuple(client.worker_urls), client=cfg, sample_retries=2,
                          backoff_s=0.05)
    turns = EngineTurns(engine,
                        producer_id="p", client=lambda: client, halts=halts,
                        book=StatsBook(ProducerStats()))
    return turns, ActiveGroup(lease=lease, run=run)


def _kill_mid_segment(stream: bool) -> dict[str, int]:
    """One 400-token sample on two sim engines (10 ms a token); the engine it runs on is
    killed with ``kill -9`` once it generated 100 tokens; the sample finishes on the other."""
    engines = [start_engine_subprocess("sim", step_base_ms=10.0, len_median=10**5,
                                       len_cap=10**5, cap_prob=1.0) for _ in range(2)]
    try:
        cfg = ClientConfig(stream=stream, stream_interval=8, max_retries=2,
                           backoff_base_s=0.05, backoff_max_s=0.1)
        client = SGLangClient([e.url for e in engines], config=cfg)

        async def go() -> dict[str, int]:
            async with client, aiohttp.ClientSession() as http:
                turns, a = _turns(client, cfg)
                assert a.run is not None
                s = a.run.samples[0]
                task = asyncio.create_task(turns.turn(a, 0, lambda: False))
                while True:  # find the engine it runs on, and its progress
                    lives = [await _live(http, e.url) for e in engines]
                    busy = [i for i, b in enumerate(lives) if b["requests"]]
                    if busy and lives[busy[0]]["requests"][0]["output_tokens"] >= 100:
                        break
                    await asyncio.sleep(0.01)
                victim, other = engines[busy[0]], engines[1 - busy[0]]
                before_other = (await _live(http, other.url))["generated_tokens"]
                seen = lives[busy[0]]["requests"][0]["output_tokens"]
                victim.kill()
                finish = await task
                assert finish == "length" and s.response_length == 400
                redone = (await _live(http, other.url))["generated_tokens"] - before_other
                return {"seen_on_victim": seen, "other_generated": redone,
                        "kept": 400 - redone, "segments": s.num_segments}

        return asyncio.run(go())
    finally:
        for e in engines:
            e.stop()


@pytest.mark.process
@pytest.mark.slow
def test_an_engine_killed_mid_segment_costs_only_what_was_not_received() -> None:
    out = _kill_mid_segment(stream=True)
    # the other engine generated only what the sample did not hold: the 100+ tokens
    # generated on the victim and received are kept, none generated twice
    kept = out["kept"]
    assert kept >= out["seen_on_victim"] - 2 * 8  # at most a chunk or two in flight
    assert out["other_generated"] == 400 - kept
    assert out["segments"] == 2  # the kept prefix, then the rest: nothing duplicated
    plain = _kill_mid_segment(stream=False)
    assert plain["kept"] == 0 and plain["other_generated"] == 400  # before: all lost
    print(f"streamed: kept {kept} of {out['seen_on_victim']}+ generated on the killed engine "
          f"(regenerated <= {out['seen_on_victim'] - kept} + what it made after the read); "
          f"unstreamed: kept 0, regenerated all {plain['seen_on_victim']}+")
