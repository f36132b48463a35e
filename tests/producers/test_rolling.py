"""Rolling weight updates: the trainer publishes version v once and returns; producers load it
into their engines a wave at a time; replies from an engine within the lag are applied with
their exact stamps; a resumed prefix goes to an engine of its own version."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.producers.engine_versions import (
    NoFreshEngine,
    StaleEngine,
    VersionGuard,
    born_at,
    resuming,
)
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    SamplerParams,
    TimingConfig,
)
from strawq.producers.sglang_protocol import GenerateResult
from strawq.storage import MemoryStorage
from strawq.tasks.queue import RunQueue
from strawq.weights.control import read_state
from strawq.weights.engine_weights import EngineWeights
from strawq.weights.publish import WeightsConflict, WeightStore, checksum_dir, wave_width
from tests.producers.helpers import make_run, ready_groups, run_producers, wait_for

pytestmark = pytest.mark.timeout(120)

SIM = SimConfig(time_scale=0.2, len_median=20, len_sigma=0.5, len_cap=60, cap_prob=0.0)


def weights(tmp: Path, version: int, body: bytes | None = None) -> str:
    d = tmp / f"w{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.bin").write_bytes(body if body is not None else bytes([version]) * 64)
    (d / "config.json").write_text("{}")
    return str(d)


# -- the store -----------------------------------------------------------------------------------
def test_a_manifest_is_written_once_per_version(tmp_path: Path) -> None:
    store = WeightStore(MemoryStorage())
    assert store.newest() is None
    m = store.publish(1, weights(tmp_path, 1), wave=2, max_lag=1)
    assert store.newest() == m and m.files == 2 and m.bytes == 66
    assert store.publish(1, weights(tmp_path, 1), wave=2, max_lag=1) == m  # a retry: no-op
    other = weights(tmp_path / "other", 1, b"different")
    with pytest.raises(WeightsConflict, match="already published"):
        store.publish(1, other, wave=2, max_lag=1)
    store.verify(m)
    Path(m.path, "model.bin").write_bytes(b"changed since")
    with pytest.raises(WeightsConflict, match="changed since"):
        store.verify(m)
    with pytest.raises(WeightsConflict, match="do not exist"):
        checksum_dir(tmp_path / "nowhere")


def test_a_wave_holds_at_most_its_width(tmp_path: Path) -> None:
    store = WeightStore(MemoryStorage())
    m = store.publish(3, weights(tmp_path, 3), wave=2, max_lag=1)
    a = store.claim_slot(m, "p1", "http://a")
    assert a in (0, 1)
    assert store.claim_slot(m, "p1", "http://a") is None  # that engine is loading already
    assert store.claim_slot(m, "p2", "http://b") == 1 - a
    assert store.claim_slot(m, "p2", "http://c") is None  # the wave is full
    store.release_slot(3, a)
    assert store.claim_slot(m, "p2", "http://c") == a
    assert store.release_mine("p2") == 2 and store.slots(3) == []


def test_old_manifests_and_their_slots_are_collected(tmp_path: Path) -> None:
    store = WeightStore(MemoryStorage())
    first = store.publish(1, weights(tmp_path, 1), wave=1, max_lag=1)
    assert store.claim_slot(first, "dead", "http://a") == 0
    for v in range(2, 7):
        store.publish(v, weights(tmp_path, v), wave=1, max_lag=1)
    assert store.manifest(1) is None and store.slots(1) == []
    assert store.manifest(3) is not None and store.newest() == store.manifest(6)


def test_wave_width() -> None:
    assert wave_width(0.25, 8) == 2 and wave_width(0.25, 2) == 1 and wave_width(3, 8) == 3
    with pytest.raises(ValueError):
        wave_width(0, 8)


# -- the trainer ---------------------------------------------------------------------------------
def test_publishing_pauses_nobody_and_announces_the_version(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)
    with pytest.raises(ValueError, match="weight_update"):
        WeightUpdateBracket(q, weight_update="rollin")
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=0.5, max_lag=1,
                                  engine_urls=["http://a", "http://b", "http://c", "http://d"],
                                  sleep=lambda s: pytest.fail("the rolling update waited"))
    rep = bracket.weight_update(lambda v: weights(tmp_path, v))
    assert rep.version == 1 and q.current_version() == 1 and not rep.acked
    assert rep.published is not None and rep.published.wave == 2
    assert not read_state(q.storage).paused and not q.storage.list("control")
    assert WeightStore(q.storage).newest() == rep.published
    assert bracket.publish_weights(lambda v: weights(tmp_path, v)).version == 2
    with pytest.raises(Exception, match="must return the directory"):
        bracket.publish_weights(lambda v: None)


# -- the guard -----------------------------------------------------------------------------------
class _Client:
    worker_urls = ["http://e1", "http://e2"]
    router_url = None
    versions = {"http://e1": 5, "http://e2": 6}

    async def weight_version(self, url: str) -> int:
        return self.versions[url]


def _reply(version: int, spans: list[int], url: str) -> GenerateResult:
    n = len(spans)
    return GenerateResult(rid="r", output_ids=np.arange(n, dtype=np.int32),
                          logprobs=np.zeros(n, np.float32), versions=np.asarray(spans, np.int64),
                          finish_reason={"type": "length"}, weight_version=version,
                          completion_tokens=n, prompt_tokens=1, cached_tokens=0,
                          num_retractions=0, text="", url=url, meta_info={})


def test_an_engine_within_the_lag_serves_and_resumes_route_by_version(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)
    q.set_version(6)
    book = StatsBook(ProducerStats())

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    guard = VersionGuard("p1", client=_Client, current_version=q.current_version,
                         notes=EngineWeights(q.storage), io=io, pausing=lambda: False,
                         book=book)

    async def main() -> None:
        with pytest.raises(StaleEngine):  # the bracket mode: the run's version only
            await guard.check(_reply(5, [5, 5], "http://e1"))
        guard.stale.clear()
        guard.lag = 1  # rolling, one version of lag
        await guard.check(_reply(5, [5, 5], "http://e1"))
        await guard.check(_reply(6, [6], "http://e2"))
        with pytest.raises(StaleEngine):  # two behind: out
            await guard.check(_reply(4, [4], "http://e1"))
        guard.stale.clear()
        guard.versions.update({"http://e1": 5, "http://e2": 6})
        urls = list(_Client.worker_urls)
        # a fresh sample: the run's version (on e1 it would start a group with tokens older
        # than its release; it was "any engine" before)
        assert guard.route(urls) == ["http://e2"]
        with resuming(np.array([5, 5, 5])):
            assert guard.route(urls) == ["http://e1"]  # its own version (no η known)
        guard.eta = 2
        with resuming(np.array([5, 5, 5])):  # 5 + 2 > 6: trained a version from now is
            assert guard.route(urls) == ["http://e1"]  # still within η
        guard.eta = 1
        with resuming(np.array([5, 5, 5])):  # due now: not to an engine about to be loaded
            assert guard.route(urls) == ["http://e2"]
        guard.eta = 2
        with resuming(np.array([4, 5, 5])):  # its oldest token decides: 4 + 2 == 6
            assert guard.route(urls) == ["http://e2"]
        guard.versions.update({"http://e2": 5})  # the run at 6, no engine loaded it yet
        guard.eta = 1
        with pytest.raises(NoFreshEngine):  # a fresh group would be due before it ends
            guard.route(urls)
        with resuming(np.array([5, 5, 5])):  # a prefix goes on: no token older than it has
            assert guard.route(urls) == urls
        guard.eta = 2
        assert guard.route(urls) == urls  # 5 + 2 > 6: a fresh group on 5 is within η
        guard.versions.update({"http://e2": 6})
        guard.eta = None
        # a group load read version 7 (released at 7 at most) before the guard's refresh:
        # routing goes by the newest view (its view of 6 would send it to e2, on 6)
        guard.versions.update({"http://e1": 7})
        guard.saw_version(7)
        guard.saw_version(5)  # an older read never moves it back
        assert guard.expected == 7 and guard.route(urls) == ["http://e1"]
        guard.expected = 6
        guard.versions.update({"http://e1": 5})
        # a fresh segment of a group loaded at 6 answered by a lagging engine (a route by an
        # older view): refused, not applied; the engine stays in rotation for prefixes
        with born_at(6):
            guard.check_born(_reply(5, [5, 5], "http://e1"))  # η unknown: as the route
            guard.eta = 1
            with pytest.raises(StaleEngine, match="loaded at version 6"):
                guard.check_born(_reply(5, [5, 5], "http://e1"))
            guard.check_born(_reply(6, [6, 6], "http://e2"))
            guard.eta = 2
            guard.check_born(_reply(5, [5, 5], "http://e1"))  # 5 + 2 > 6: within η
            guard.eta = None
        guard.check_born(_reply(5, [5, 5], "http://e1"))  # a group of no known load
        assert guard.serves("http://e1")
        guard.lag = 0
        with resuming(np.array([5, 5, 5])):
            assert guard.route(urls) == ["http://e2"]  # its version may no longer serve
        guard.lag = 1
        guard.loading.add("http://e1")
        assert guard.usable(urls) == ["http://e2"]  # loading: out of rotation

    asyncio.run(main())


class _Resumer(_Client):
    """Two engines, e1 on 5 and e2 on 6, each with a prefix cache of ``cached[url]`` tokens;
    ``generate`` answers on the first engine of ``among``, one token of its version."""

    cached = {"http://e1": 6, "http://e2": 3}

    async def generate(self, input_ids: Any, sampling_params: Any, *, rid: Any = None,
                       among: Any = None, extra: Any = None, live: Any = None) -> GenerateResult:
        url = list(among)[0]
        return dataclasses.replace(_reply(self.versions[url], [self.versions[url]], url),
                                   prompt_tokens=len(input_ids),
                                   cached_tokens=self.cached[url])


def test_a_resumed_prefix_counts_the_tokens_its_engine_prefilled_again(tmp_path: Path) -> None:
    """A prefix of 5 tokens (version 5) after a 3-token prompt: on e1, its own version, 6 of
    the 8 prompt tokens were cached, so 2 of the prefix were prefilled again; due at η = 1 it
    goes to e2 (version 6), which cached the prompt only: all 5 prefilled again, and 5 tokens
    resumed on another version's engine. A fresh segment counts nothing."""
    from strawq.producers.engine_versions import GuardedClient

    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)
    q.set_version(6)
    book = StatsBook(ProducerStats())
    inner = _Resumer()

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    guard = VersionGuard("p1", client=lambda: inner, current_version=q.current_version,
                         notes=EngineWeights(q.storage), io=io, pausing=lambda: False,
                         book=book)
    guard.lag = 1
    guard.expected = 6
    guard.versions.update(_Client.versions)
    client = GuardedClient(inner, guard)  # type: ignore[arg-type]
    prompt, prefix = [1, 2, 3], [7] * 5

    async def main() -> None:
        with resuming(np.array([5] * 5)):
            assert (await client.generate(prompt + prefix, {})).url == "http://e1"
        st = book.snapshot()
        assert (st.resumed_tokens, st.resumed_tokens_prefilled,
                st.resumed_tokens_other_version) == (5, 2, 0)
        guard.eta = 1
        with resuming(np.array([5] * 5)):
            assert (await client.generate(prompt + prefix, {})).url == "http://e2"
        await client.generate(prompt, {})  # a fresh segment: no prefix, nothing counted

    asyncio.run(main())
    st = book.snapshot()
    assert (st.resumed_tokens, st.resumed_tokens_prefilled,
            st.resumed_tokens_other_version) == (10, 7, 5)


# -- end to end on the local engines -------------------------------------------------------------
def _run(run_dir: str, n: int) -> RunQueue:
    q = make_run(run_dir, 0, rows=[], group_size=2, release_batch=n)
    with open(os.path.join(run_dir, "dataset.jsonl"), "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": [5 + i % 50, 9, 11], "target": 7, "count": 3}) + "\n")
    return q


def _run_on(p: Producer, engines: list[EngineThread],
            body: Callable[[], Awaitable[None]]) -> None:
    """Run producer ``p`` while ``body`` drives the run; stop ``engines`` (the list as it
    is then: a body may replace one) whatever happens."""
    try:
        asyncio.run(run_producers([p], body))
    finally:
        for e in engines:
            e.stop()


def _producer(run_dir: str, workers: tuple[str, ...]) -> Producer:
    return Producer(ProducerConfig(
        run_dir=run_dir,
        engine=EngineConfig(workers=workers, backoff_s=0.05),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        sampling=SamplerParams(max_new_tokens=60, seed=1),
        budget=BudgetConfig(slots=6),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))


def _versions(q: RunQueue) -> list[list[int]]:
    out = []
    for grp in ready_groups(q).values():
        for i in range(len(grp.sample_lens)):
            out.append(np.asarray(grp.sample(i)["versions"]).tolist())
    return out


def _count_concurrent_loads(p: Producer) -> list[int]:
    """[now, most] engines of ``p`` loading at once (wrapping its pull)."""
    seen = [0, 0]
    pull = p.rolling.pull

    async def counted(*args: Any) -> None:
        seen[0] += 1
        seen[1] = max(seen[1], seen[0])
        try:
            await pull(*args)
        finally:
            seen[0] -= 1
    p.rolling.pull = counted  # type: ignore[method-assign]
    return seen


def test_engines_load_a_published_version_one_wave_at_a_time(tmp_path: Path) -> None:
    """Three engines, a wave of one: the fleet never pauses at once, every engine ends on
    the new version, no reply is discarded, and per-token versions only go up."""
    run_dir = str(tmp_path / "run")
    n = 24
    q = _run(run_dir, n)
    engines = [EngineThread(EngineOptions(kind="sim", max_running=64, weight_version="0",
                                          sim=SIM)) for _ in range(3)]
    p = _producer(run_dir, tuple(e.url for e in engines))
    seen = _count_concurrent_loads(p)
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1,
                                  sleep=lambda s: pytest.fail("the rolling update waited"))

    async def body() -> None:
        Feeder(q, Dataset(os.path.join(run_dir, "dataset.jsonl"))).release(n // 2)
        await wait_for(lambda: p.stats().tokens_generated > 50, 60, "generation under way")
        await asyncio.to_thread(bracket.weight_update, lambda v: weights(tmp_path, v))
        Feeder(q, Dataset(os.path.join(run_dir, "dataset.jsonl"))).release(n // 2)
        await wait_for(lambda: p.stats().rolling_loads == 3, 60, "every engine loaded")
        await wait_for(lambda: len(ready_groups(q)) == n, 60, "every group")

    _run_on(p, engines, body)
    st = p.stats()
    assert seen[1] == 1, f"{seen[1]} engines loaded at once with a wave of one"
    assert st.brackets == 0 and st.stale_replies == 0 and st.rolling_load_failures == 0
    assert st.groups_dropped == 0
    assert set(p.guard.versions.values()) == {1}
    spans = _versions(q)
    assert {v for s in spans for v in s} <= {0, 1}
    assert all(s == sorted(s) for s in spans), "a token older than the one before it"
    assert WeightStore(q.storage).slots(1) == []  # every slot released


def _from_version_0(tmp_path: Path, *, version: int, wave: int,
                    max_lag: int) -> tuple[RunQueue, Producer]:
    """A run whose ``version`` was published (rolling, ``wave``, ``max_lag``) before its
    producer starts on two sim engines at version 0; run until its 8 groups are ready."""
    run_dir = str(tmp_path / "run")
    n = 8
    q = _run(run_dir, n)
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=wave, max_lag=max_lag)
    bracket.publish_weights(lambda v: weights(tmp_path, v), version=version)
    engines = [EngineThread(EngineOptions(kind="sim", max_running=64, weight_version="0",
                                          sim=SIM)) for _ in range(2)]
    p = _producer(run_dir, tuple(e.url for e in engines))

    async def body() -> None:
        Feeder(q, Dataset(os.path.join(run_dir, "dataset.jsonl"))).release(n)
        await wait_for(lambda: len(ready_groups(q)) == n, 60, "every group")

    _run_on(p, engines, body)
    return q, p


def test_an_engine_behind_the_lag_loads_the_newest_version_before_it_takes_work(
        tmp_path: Path) -> None:
    """Engines started on version 0 while the run's version 2 was published with no lag:
    they are out of rotation until they loaded it, so every trained token is of version 2."""
    q, p = _from_version_0(tmp_path, version=2, wave=2, max_lag=0)
    assert {v for s in _versions(q) for v in s} == {2}
    assert p.stats().rolling_loads == 2 and p.stats().tokens_generated > 0


def test_a_new_engine_within_the_lag_loads_the_newest_version_before_it_takes_work(
        tmp_path: Path) -> None:
    """Engines started on version 0 while the run's version 1 was published with a lag of
    one: 0 is within the lag, but the engines are new to the producer, so each is out of
    rotation until it loaded 1 (a wave of one: one at a time). Before, both served at once
    on 0 while the first one loaded, and tokens of version 0 were trained."""
    q, p = _from_version_0(tmp_path, version=1, wave=1, max_lag=1)
    assert {v for s in _versions(q) for v in s} == {1}
    st = p.stats()
    assert st.rolling_loads == 2 and st.tokens_generated > 0 and st.groups_dropped == 0
    assert not p.guard.joining


def test_a_restarted_engine_loads_the_newest_version_before_it_takes_work(
        tmp_path: Path) -> None:
    """Two engines on the run's published version 1 (lag one); one restarts on version 0
    (an old checkpoint) between two batches of work. Its first reply after the restart
    shows a version older than the one it had: discarded (re-issued on the other engine),
    and the engine is out of rotation until it loaded 1 again. Before, it stayed in
    rotation on 0 (within the lag; every engine had been settled on 1, so it was not even
    loaded again) and its tokens of version 0 were trained in groups released at 1."""
    run_dir = str(tmp_path / "run")
    n = 16
    q = _run(run_dir, n)
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1)
    bracket.publish_weights(lambda v: weights(tmp_path, v), version=1)
    engines = [EngineThread(EngineOptions(kind="sim", max_running=64, weight_version="1",
                                          sim=SIM)) for _ in range(2)]
    p = _producer(run_dir, tuple(e.url for e in engines))
    feeder = Feeder(q, Dataset(os.path.join(run_dir, "dataset.jsonl")))

    async def body() -> None:
        feeder.release(n // 2)
        await wait_for(lambda: len(ready_groups(q)) == n // 2, 60, "the first half")
        assert p.stats().rolling_loads == 0 and not p.guard.joining
        port = int(engines[1].url.rsplit(":", 1)[1])
        await asyncio.to_thread(engines[1].stop)
        engines[1] = await asyncio.to_thread(lambda: EngineThread(
            EngineOptions(kind="sim", max_running=64, weight_version="0", sim=SIM),
            port=port))
        feeder.release(n // 2)
        await wait_for(lambda: len(ready_groups(q)) == n, 60, "every group")

    _run_on(p, engines, body)
    assert {v for s in _versions(q) for v in s} == {1}
    st = p.stats()
    assert st.rolling_loads == 1 and st.groups_dropped == 0
    assert p.guard.versions[engines[1].url] == 1 and not p.guard.joining


def test_only_a_new_or_restarted_engine_behind_the_run_is_held_out(tmp_path: Path) -> None:
    """The guard: an engine in rotation that lags within the lag (the run moved on; its
    wave has not come) keeps serving; one first seen behind the run's published version,
    or seen going back, is held out until it loaded; a reply carrying the version an
    engine had before a load that ended after the request was sent is no restart."""
    q, bracket, client, book, guard, pull = loader_pull(tmp_path, wave=1, at=1)
    urls = list(client.worker_urls)

    async def main() -> None:
        await guard.probe_all()  # both on the run's version 1: in rotation
        assert guard.usable(urls) == urls and not guard.joining
        bracket.publish_weights(lambda v: weights(tmp_path, v))  # version 2, lag 1
        await guard.refresh()
        await guard.probe_all()  # in rotation on 1, one behind: they keep serving
        assert guard.usable(urls) == urls and not guard.joining
        await guard.check(_reply(1, [1, 1], "http://e1"), sent=guard.loads_ended)
        client.worker_urls.append("http://e3")  # a new engine on 1
        client.at["http://e3"] = 1
        await guard.probe_all()
        assert guard.joining == {"http://e3"} and guard.usable(
            client.worker_urls) == ["http://e1", "http://e2"]
        # e2 restarts on 0: its reply is discarded and it is held out too
        with pytest.raises(StaleEngine, match="restart"):
            await guard.check(_reply(0, [0, 0], "http://e2"), sent=guard.loads_ended)
        assert guard.joining == {"http://e2", "http://e3"}
        assert guard.usable(client.worker_urls) == ["http://e1"]
        # the wave of one loads them one by one (a step each); e1 too, in its turn
        for _ in range(3):
            await pull.step()
            await asyncio.gather(*pull.pulls.values())
        assert sorted(client.loads) == [("http://e1", 2), ("http://e2", 2), ("http://e3", 2)]
        assert not guard.joining and guard.usable(client.worker_urls) == client.worker_urls
        # a reply sent before e1's load, carrying its version before it: not a restart
        await guard.check(_reply(1, [1], "http://e1"), sent=0)
        assert not guard.joining

    asyncio.run(main())
    assert book.snapshot().stale_replies == 1


class _Loader:
    """Two engines that load what they are told (no generation)."""

    router_url = None

    def __init__(self) -> None:
        self.worker_urls = ["http://e1", "http://e2"]
        self.at = {u: 0 for u in self.worker_urls}
        self.loads: list[tuple[str, int]] = []

    async def weight_version(self, url: str) -> int:
        return self.at[url]

    async def push_weights(self, model_path: str, *, weight_version: int,
                           url: str | None = None) -> dict[str, Any]:
        assert url is not None
        self.loads.append((url, weight_version))
        self.at[url] = weight_version
        return {url: {"success": True}}


def loader_pull(tmp_path: Path, *, wave: int, after_load: Any = None,
                clock: Callable[[], float] = lambda: 0.0, poll_s: float = 0.0,
                fingerprint: Any = None, at: int = 0) -> tuple[Any, ...]:
    """A run with version 1 published (rolling, ``wave`` engines at once, with
    ``fingerprint``), two fake engines labelled ``at`` and a producer's guard and puller
    over them: (queue, bracket, client, book, guard, pull)."""
    from strawq.producers.rolling import RollingPull

    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=wave, max_lag=1)
    bracket.weight_update(lambda v: weights(tmp_path, v), fingerprint=fingerprint)
    client = _Loader()
    client.at = {u: at for u in client.worker_urls}
    book = StatsBook(ProducerStats())

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    guard = VersionGuard("p1", client=lambda: client, current_version=q.current_version,
                         notes=EngineWeights(q.storage), io=io, pausing=lambda: False,
                         book=book)
    pull = RollingPull("p1", store=WeightStore(q.storage), client=lambda: client, guard=guard,
                       io=io, book=book, clock=clock, poll_s=poll_s, after_load=after_load)
    return q, bracket, client, book, guard, pull


def test_the_hook_after_a_load_keeps_a_refused_engine_out_until_it_passes(
        tmp_path: Path) -> None:
    from strawq.producers.rolling import RETRY_MIN_S

    checks: list[tuple[str, int]] = []

    async def after_load(url: str, version: int) -> None:
        checks.append((url, version))
        if url == "http://e2" and len(checks) == 2:
            raise ValueError("fingerprint mismatch")

    now = [0.0]
    q, _b, client, book, guard, pull = loader_pull(tmp_path, wave=1, after_load=after_load,
                                                   clock=lambda: now[0])

    async def settle() -> None:
        await pull.step()
        await asyncio.gather(*pull.pulls.values())

    async def main() -> None:
        await settle()  # the wave of one: e1 only
        assert client.loads == [("http://e1", 1)] and guard.lag == 1
        await settle()  # e2, refused by the hook: out of rotation
        assert client.loads[-1] == ("http://e2", 1) and "http://e2" in guard.loading
        assert guard.usable(list(client.worker_urls)) == ["http://e1"]
        await settle()  # within its backoff: not loaded again yet
        assert len(client.loads) == 2 and pull.backoff["http://e2"][:2] == (1, 1)
        now[0] += RETRY_MIN_S
        await settle()  # loaded again, passes: back in rotation
        assert client.loads[-1] == ("http://e2", 1) and not guard.loading
        await settle()  # nothing left to load
        assert len(client.loads) == 3 and WeightStore(q.storage).slots(1) == []

    asyncio.run(main())
    st = book.snapshot()
    assert st.rolling_loads == 2 and st.rolling_load_failures == 1
    assert not pull.backoff


def test_an_engine_refused_at_every_load_is_tried_again_after_a_doubling_backoff(
        tmp_path: Path) -> None:
    """Before: an engine that kept loading the wrong weights was loaded again at every poll
    (each a pause, a load and a check). Now at 1, 2, 4, ... s, at most a minute apart; a
    newer version is tried at once."""
    from strawq.producers.rolling import RETRY_MAX_S, RETRY_MIN_S

    async def after_load(url: str, version: int) -> None:
        if url == "http://e2":
            raise ValueError("fingerprint mismatch")

    now = [0.0]
    q, bracket, client, book, guard, pull = loader_pull(
        tmp_path, wave=2, after_load=after_load, clock=lambda: now[0], poll_s=0.25)
    tried: list[tuple[float, int]] = []

    async def main() -> None:
        while now[0] < 300:  # five minutes of polls every 0.25 s
            n = len(client.loads)
            await pull.step()
            await asyncio.gather(*pull.pulls.values())
            tried.extend((now[0], v) for u, v in client.loads[n:] if u == "http://e2")
            if now[0] == 200:
                bracket.publish_weights(lambda v: weights(tmp_path, v))  # version 2
            now[0] += 0.25

    asyncio.run(main())
    at1 = [t for t, v in tried if v == 1]
    gaps = [b - a for a, b in zip(at1, at1[1:], strict=False)]
    assert gaps[:6] == [RETRY_MIN_S * 2 ** i for i in range(6)], gaps
    assert max(gaps) == RETRY_MAX_S and at1[-1] < 200
    at2 = [t for t, v in tried if v == 2]
    assert at2[0] == 200.25 and at2[1] - at2[0] == RETRY_MIN_S  # a new version: at once
    assert "http://e2" in guard.loading and guard.usable(["http://e1", "http://e2"]) == [
        "http://e1"]
    assert book.snapshot().rolling_load_failures == len(tried) < 20


def test_a_reply_from_the_old_version_just_after_a_publish_is_applied(tmp_path: Path) -> None:
    """The trainer published version 1 a moment ago and no pull step ran yet: an engine's
    reply on version 0 is within the published lag, not a stale engine's."""
    from strawq.producers.rolling import RollingPull

    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)
    client = _Loader()
    book = StatsBook(ProducerStats())

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    notes = EngineWeights(q.storage)
    guard = VersionGuard("p1", client=lambda: client, current_version=q.current_version,
                         notes=notes, io=io, pausing=lambda: False, book=book)
    RollingPull("p1", store=WeightStore(q.storage), client=lambda: client, guard=guard,
                io=io, book=book, clock=lambda: 0.0, poll_s=0.0)

    async def main() -> None:
        await guard.check(_reply(0, [0, 0], "http://e1"))
        WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1).publish_weights(
            lambda v: weights(tmp_path, v))
        await guard.check(_reply(1, [1], "http://e2"))  # an engine already on 1
        await guard.check(_reply(0, [0, 0], "http://e1"))  # no pull step ran since
        assert guard.lag == 1 and not guard.stale and not notes.notes()

    asyncio.run(main())
    assert book.snapshot().stale_replies == 0


def test_a_producer_waiting_for_a_wave_slot_looks_for_one_without_rereading_the_run(
        tmp_path: Path) -> None:
    """Before: a producer whose engines waited for a wave slot made a full step at every
    0.1 s poll (the manifest twice, the run's version, control/, the verdicts, and every
    held slot's record): 585 storage calls in 10 s here, per producer, for the whole of a
    rolling update. Now one listing of ``weights/`` every ``WAVE_RETRY_S`` (its own
    multiple), doubling to ``WAVE_RETRY_MAX_S``, and a full step only when something it
    reads may have changed; a slot that frees is still taken within one look."""
    from strawq.producers.rolling import WAVE_RETRY_MAX_S, WAVE_RETRY_S

    now = [0.0]
    q, _b, client, _book, _guard, pull = loader_pull(tmp_path, wave=1, clock=lambda: now[0],
                                                     poll_s=0.1)
    store = WeightStore(q.storage)
    m = store.newest()
    assert m is not None and store.claim_slot(m, "other", "http://x") == 0  # the wave: full
    calls: list[str] = []
    def counting(name: str) -> Callable[..., Any]:
        call = getattr(q.storage, name)

        def counted(key: str, *a: Any, **kw: Any) -> Any:
            calls.append(f"{name} {key}")
            return call(key, *a, **kw)
        return counted

    for name in ("list", "read", "publish", "delete"):
        setattr(q.storage, name, counting(name))

    async def run_until(t: float) -> None:
        while now[0] < t:
            pull.tick()
            if pull._step is not None:
                await pull._step
            await asyncio.sleep(0)
            now[0] = round(now[0] + 0.1, 6)

    async def main() -> None:
        await run_until(60.0)
        assert client.loads == []  # the wave stayed full
        waiting = list(calls)
        slot_reads = [c for c in waiting if c.startswith("read weights/wave-")]
        assert not slot_reads, slot_reads
        # a listing a look (the wait doubling from WAVE_RETRY_S, five times at most before
        # it reaches WAVE_RETRY_MAX_S), and a full step (8 calls) at most every FULL_STEP_S
        # and once after it: far from 600 polls' full steps
        # a full step reads the manifest once (the lag is read from it, not a second time)
        full_steps = sum(c == "list versions" for c in waiting)
        assert sum(c.startswith("read weights/manifest-") for c in waiting) == full_steps
        doubling = math.ceil(math.log2(WAVE_RETRY_MAX_S / WAVE_RETRY_S))
        assert len(waiting) <= doubling + 60 / (WAVE_RETRY_MAX_S * 0.5) + 6 * 8, waiting
        store.release_slot(1, 0)
        await run_until(60.0 + 1.5 * WAVE_RETRY_MAX_S + 0.2)
        await asyncio.gather(*pull.pulls.values())
        assert client.loads[:1] == [("http://e1", 1)]

    asyncio.run(main())
