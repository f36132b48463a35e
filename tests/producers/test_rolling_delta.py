"""Rolling weight updates published as a delta against a base (``strawq.weights.delta``):
only the changed files are written, the manifest names the base; a producer builds base +
delta on its local disk and its engine serves exactly the version's weights; a chain is
bounded; a needed base is kept; a missing or changed base is refused; a crash before the
manifest leaves nothing a loader sees."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.producers.engine_versions import VersionGuard
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig, sim_weights
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.tiny_model import init_model, save_weights
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    TimingConfig,
)
from strawq.producers.rolling import RollingPull
from strawq.producers.sglang_client import SGLangClient
from strawq.tasks.queue import RunQueue
from strawq.weights.delta import BaseUnavailable, DeltaRefused, delta_checksum_of, prune
from strawq.weights.engine_weights import EngineWeights
from strawq.weights.fingerprint import attest, attest_all, engine_fingerprint, fingerprint_of
from strawq.weights.publish import WeightsConflict, WeightStore, checksum_dir
from tests.producers.helpers import make_run, run_producers, wait_for
from tests.producers.test_engine_versions import TINY

pytestmark = pytest.mark.timeout(120)


def shards(tmp: Path, version: int, **files: bytes) -> str:
    """A checkpoint directory: ``files`` (name -> bytes) plus an unchanged config."""
    d = tmp / "trainer" / f"step{version}"
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model": "x"}')
    for name, body in files.items():
        (d / name).write_bytes(body)
    return str(d)


BASE = {"a.safetensors": b"a" * 4000, "b.safetensors": b"b" * 4000,
        "c.safetensors": b"c" * 4000}


def rolling(tmp: Path, **kw: Any) -> tuple[RunQueue, WeightUpdateBracket]:
    q = make_run(str(tmp / "run"), 0, rows=[], group_size=2)
    return q, WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1,
                                  publish_dir=str(tmp / "published"), **kw)


def published(tmp: Path) -> list[str]:
    return sorted(os.listdir(tmp / "published"))


# -- the trainer's side --------------------------------------------------------------------------
def test_a_delta_publish_writes_only_the_changed_files_and_names_its_base(
        tmp_path: Path) -> None:
    q, bracket = rolling(tmp_path)
    m1 = bracket.publish_weights(lambda v: shards(tmp_path, v, **BASE)).published
    assert m1 is not None and not m1.is_delta and m1.written == m1.bytes == 12014
    assert sorted(os.listdir(m1.path)) == ["a.safetensors", "b.safetensors",
                                           "c.safetensors", "config.json"]
    w2 = shards(tmp_path, 2, **{**BASE, "b.safetensors": b"B" * 4000})
    m2 = bracket.publish_weights(lambda v: w2).published
    assert m2 is not None and m2.is_delta and (m2.base, m2.chain) == (1, 1)
    assert m2.base_checksum == m1.checksum
    assert os.listdir(m2.path) == ["b.safetensors"] and m2.written == 4000
    assert m2.delta_checksum == delta_checksum_of(m2.path)
    assert m2.checksum == checksum_dir(w2)[0]  # the whole version's, as a full publish's
    assert WeightStore(q.storage).newest() == m2 and q.current_version() == 2
    # a file removed and one added: the delta holds the new one, the listing drops the old
    w3 = shards(tmp_path, 3, **{"a.safetensors": BASE["a.safetensors"],
                                "b.safetensors": b"B" * 4000, "d.safetensors": b"d" * 10})
    m3 = bracket.publish_weights(lambda v: w3).published
    assert m3 is not None and m3.base == 2 and os.listdir(m3.path) == ["d.safetensors"]
    assert sorted(m3.listing) == ["a.safetensors", "b.safetensors", "config.json",
                                  "d.safetensors"]
    built = WeightStore(q.storage).materialize(m3, tmp_path / "node")
    assert sorted(os.listdir(built)) == sorted(m3.listing)
    assert checksum_dir(built)[0] == checksum_dir(w3)[0] == m3.checksum


def test_a_chain_beyond_max_delta_chain_publishes_full(tmp_path: Path) -> None:
    _, bracket = rolling(tmp_path, max_delta_chain=2)
    kinds = []
    for v in range(1, 7):
        m = bracket.publish_weights(
            lambda v: shards(tmp_path, v, **{**BASE, "a.safetensors": bytes([v]) * 4000})
        ).published
        assert m is not None
        kinds.append((m.base, m.chain))
    assert kinds == [(None, 0), (1, 1), (2, 2), (None, 0), (4, 1), (5, 2)]
    # a version where every file changed is full: a delta would write as much
    m = bracket.publish_weights(lambda v: shards(tmp_path, v, z=b"z")).published
    assert m is not None and not m.is_delta
    with pytest.raises(ValueError, match="max_delta_chain"):
        rolling(tmp_path / "other", max_delta_chain=-1)


def test_max_delta_chain_zero_or_no_publish_dir_publishes_every_version_full(
        tmp_path: Path) -> None:
    _, bracket = rolling(tmp_path, max_delta_chain=0)
    for v in (1, 2):
        m = bracket.publish_weights(
            lambda v: shards(tmp_path, v, **{**BASE, "a.safetensors": bytes([v]) * 4000})
        ).published
        assert m is not None and not m.is_delta and m.written == m.bytes
    q = make_run(str(tmp_path / "run2"), 0, rows=[], group_size=2)
    plain = WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1)
    w = shards(tmp_path / "plain", 1, **BASE)
    m = plain.publish_weights(lambda v: w).published
    assert m is not None and not m.is_delta and m.path == os.path.realpath(w)


def test_collection_keeps_the_bases_a_kept_delta_needs(tmp_path: Path) -> None:
    q, bracket = rolling(tmp_path, max_delta_chain=6)
    store = WeightStore(q.storage)

    def publish(v: int) -> None:
        bracket.publish_weights(
            lambda v: shards(tmp_path, v, **{**BASE, "a.safetensors": bytes([v]) * 4000}))

    for v in range(1, 8):
        publish(v)
    # KEEP is 4: versions 1..3 would be collected, but 4..7 are deltas down to version 1
    assert [m.version for m in store.kept()] == list(range(1, 8))
    assert [m.chain for m in store.kept()] == list(range(7))
    assert len(published(tmp_path)) == 7
    built = store.materialize(store.manifest(7), tmp_path / "node")  # type: ignore[arg-type]
    assert checksum_dir(built)[0] == store.manifest(7).checksum  # type: ignore[union-attr]
    for v in range(8, 12):  # 8 is full (the chain is at 6), 9..11 deltas against it
        publish(v)
    assert [(m.version, m.base) for m in store.kept()] == [(8, None), (9, 8), (10, 9),
                                                           (11, 10)]
    assert sorted(published(tmp_path)) == sorted(os.path.basename(m.path)
                                                 for m in store.kept())


# -- the producer's side -------------------------------------------------------------------------
class _Loader:
    """Engines that load what they are told, recording the directory (no generation)."""

    router_url = None

    def __init__(self, *urls: str) -> None:
        self.worker_urls = list(urls)
        self.at = {u: 1 for u in self.worker_urls}
        self.loads: list[tuple[str, int, str]] = []

    async def weight_version(self, url: str) -> int:
        return self.at[url]

    async def push_weights(self, model_path: str, *, weight_version: int,
                           url: str | None = None) -> dict[str, Any]:
        assert url is not None
        self.loads.append((url, weight_version, model_path))
        self.at[url] = weight_version
        return {url: {"success": True}}


async def _io(fn: Callable[[], Any]) -> Any:
    return fn()


def puller(q: RunQueue, client: Any, cache: Path) -> RollingPull:
    book = StatsBook(ProducerStats())
    guard = VersionGuard("p1", client=lambda: client, current_version=q.current_version,
                         notes=EngineWeights(q.storage), io=_io, pausing=lambda: False,
                         book=book)
    return RollingPull("p1", store=WeightStore(q.storage), client=lambda: client,
                       guard=guard, io=_io, book=book, clock=lambda: 0.0, poll_s=0.0,
                       cache_dir=str(cache))


async def settle(pull: RollingPull) -> None:
    await pull.step()
    await asyncio.gather(*pull.pulls.values())


def test_an_engine_loads_base_plus_delta_and_serves_exactly_the_versions_weights(
        tmp_path: Path) -> None:
    """Tiny engines: one pulls version 2 published as a delta against version 1 (built on
    the producer's local disk), another loads the same weights published full; both
    hold the same weights, the fingerprint the trainer computes for version 2."""
    model = init_model(TINY)
    trainer_dir = tmp_path / "trainer"
    w1 = str(save_weights(model, trainer_dir / "step1"))
    q, bracket = rolling(tmp_path)
    bracket.publish_weights(lambda v: w1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    w2 = str(save_weights(model, trainer_dir / "step2"))
    m2 = bracket.publish_weights(lambda v: w2).published
    assert m2 is not None and m2.is_delta and os.listdir(m2.path) == ["model.pt"]
    fp = fingerprint_of(model.state_dict(), dtype="float32")
    delta_engine = EngineThread(EngineOptions(kind="tiny", max_running=4, weight_version="1",
                                              model_path=w1, tiny=TINY))
    full_engine = EngineThread(EngineOptions(kind="tiny", max_running=4, weight_version="2",
                                             model_path=w2, tiny=TINY))
    try:
        assert not attest(delta_engine.url, 2, fp).ok  # still on version 1's weights

        async def main() -> list[str]:
            async with SGLangClient([delta_engine.url]) as client:
                pull = puller(q, client, tmp_path / "node")
                await settle(pull)
                return [pull._verified[2]]

        built = asyncio.run(main())[0]
        assert built.startswith(str(tmp_path / "node"))
        assert checksum_dir(built)[0] == checksum_dir(w2)[0] == m2.checksum
        assert attest(delta_engine.url, 2, fp).ok
        assert engine_fingerprint(delta_engine.url, fp) == engine_fingerprint(
            full_engine.url, fp) == fp.digest
    finally:
        delta_engine.stop()
        full_engine.stop()


def test_a_sim_engine_attests_the_version_a_delta_assembles_to(tmp_path: Path) -> None:
    """The sim engine's weights follow the content it loaded, not its path: an engine that
    pulled version 2 as a delta (built on the producer's disk) passes the fingerprint the
    trainer took of the directory it wrote, and so does one that loaded the full copy."""
    q, bracket = rolling(tmp_path)
    bracket.publish_weights(lambda v: shards(tmp_path, v, **BASE))
    w2 = shards(tmp_path, 2, **{**BASE, "a.safetensors": b"2" * 4000})
    m2 = bracket.publish_weights(lambda v: w2).published
    assert m2 is not None and m2.is_delta
    fp = fingerprint_of(sim_weights(w2), dtype="float32")  # the trainer's, of what it wrote
    bracket.publish_fingerprint(2, fp)
    delta_engine = EngineThread(EngineOptions(kind="sim", weight_version="1"))
    full_engine = EngineThread(EngineOptions(kind="sim", weight_version="1"))
    try:
        assert not attest(delta_engine.url, 2, fp).ok  # not loaded yet

        async def main() -> str:
            async with SGLangClient([delta_engine.url]) as client:
                pull = puller(q, client, tmp_path / "node")
                await settle(pull)
                return pull._verified[2]

        built = asyncio.run(main())
        assert built.startswith(str(tmp_path / "node"))  # the delta's build, not w2
        asyncio.run(_push(full_engine.url, w2, 2))
        assert attest(delta_engine.url, 2, fp).ok and attest(full_engine.url, 2, fp).ok
        # the bracket's check records it, as after any push
        verdicts = attest_all(q.storage, [delta_engine.url], 2)
        assert verdicts[delta_engine.url].ok
    finally:
        delta_engine.stop()
        full_engine.stop()


def test_a_sim_engine_on_other_content_under_the_right_label_is_refused(
        tmp_path: Path) -> None:
    """The same path and version label, other bytes (a stale directory rewritten, a wrong
    checkpoint): the engine's fingerprint is not the published one."""
    w2 = shards(tmp_path, 2, **BASE)
    fp = fingerprint_of(sim_weights(w2), dtype="float32")
    Path(w2, "a.safetensors").write_bytes(b"x" * 4000)  # what the engine finds there
    engine = EngineThread(EngineOptions(kind="sim", weight_version="1"))
    try:
        asyncio.run(_push(engine.url, w2, 2))
        v = attest(engine.url, 2, fp)
        assert not v.ok and v.found is not None and v.found != fp.digest
        Path(w2, "a.safetensors").write_bytes(b"a" * 4000)  # the right bytes, loaded again
        asyncio.run(_push(engine.url, w2, 2))
        assert attest(engine.url, 2, fp).ok
    finally:
        engine.stop()


async def _push(url: str, path: str, version: int) -> None:
    async with SGLangClient([url]) as c:
        await c.push_weights(path, weight_version=version, url=url)


def _three_versions(tmp: Path) -> tuple[RunQueue, WeightUpdateBracket]:
    q, bracket = rolling(tmp)
    for v in (1, 2):
        bracket.publish_weights(
            lambda v: shards(tmp, v, **{**BASE, "a.safetensors": bytes([v]) * 4000}))
    return q, bracket


@pytest.mark.parametrize("fault", ["base manifest gone", "base file changed",
                                   "delta file changed", "base republished"])
def test_a_missing_or_changed_base_is_refused_and_the_engine_stays(
        tmp_path: Path, fault: str) -> None:
    q, bracket = _three_versions(tmp_path)
    store = WeightStore(q.storage)
    m1, m2 = store.manifest(1), store.manifest(2)
    assert m1 is not None and m2 is not None and m2.base == 1
    if fault == "base manifest gone":
        q.storage.delete("weights/manifest-000000000001")
        why: type[Exception] = BaseUnavailable
    elif fault == "base file changed":
        Path(m1.path, "c.safetensors").write_bytes(b"x" * 4000)
        why = DeltaRefused
    elif fault == "delta file changed":
        Path(m2.path, "a.safetensors").write_bytes(b"x" * 4000)
        why = DeltaRefused
    else:  # another version 1 under the same name: its checksum is not the one named
        key = "weights/manifest-000000000001"
        meta = {**m1.to_meta(), "checksum": "0" * 64}
        q.storage.delete(key)
        q.storage.publish(key, records.encode(Kind.STATE, meta))
        why = BaseUnavailable
    with pytest.raises(why):
        store.materialize(m2, tmp_path / "direct")
    assert not (tmp_path / "direct").exists() or not os.listdir(tmp_path / "direct")
    client = _Loader("http://e1")
    pull = puller(q, client, tmp_path / "node")
    asyncio.run(settle(pull))
    assert client.loads == [] and client.at["http://e1"] == 1  # stays on its version
    node = Path(pull.cache_dir)
    assert node.parent == tmp_path / "node"  # the producer's own directory under it
    assert not node.exists() or not os.listdir(node)  # no partial build left
    # the next version loads (here a delta against 2, which is refused too, unless full)
    bracket.publisher.max_delta_chain = 0
    bracket.publish_weights(lambda v: shards(tmp_path, v, **BASE))
    asyncio.run(settle(pull))
    assert [(u, v) for u, v, _ in client.loads] == [("http://e1", 3)]
    assert client.loads[0][2] == store.manifest(3).path  # type: ignore[union-attr]


def test_a_delta_loads_from_the_producers_own_build_and_checks_what_it_built(
        tmp_path: Path) -> None:
    q, bracket = _three_versions(tmp_path)
    client = _Loader("http://e1", "http://e2")
    client.at = {"http://e1": 0, "http://e2": 0}
    pull = puller(q, client, tmp_path / "node")
    asyncio.run(settle(pull))  # a wave of one
    asyncio.run(settle(pull))
    m2 = WeightStore(q.storage).manifest(2)
    assert m2 is not None
    paths = {p for _, _, p in client.loads}
    assert [v for _, v, _ in client.loads] == [2, 2] and len(paths) == 1
    built = paths.pop()
    assert built.startswith(str(tmp_path / "node")) and built != m2.path
    assert checksum_dir(built)[0] == m2.checksum
    # version 3, a delta against 2: built from this producer's build of 2
    bracket.publish_weights(
        lambda v: shards(tmp_path, v, **{**BASE, "a.safetensors": bytes([v]) * 4000}))
    asyncio.run(settle(pull))
    m3 = WeightStore(q.storage).manifest(3)
    assert m3 is not None and m3.base == 2
    assert client.loads[-1][1:] == (3, pull._verified[3])
    assert os.path.samefile(Path(pull._verified[3], "b.safetensors"),
                            Path(built, "b.safetensors"))  # linked, not read again


def test_a_crash_between_the_delta_and_its_manifest_leaves_nothing_a_loader_sees(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q, bracket = _three_versions(tmp_path)
    store = WeightStore(q.storage)
    client = _Loader("http://e1")
    client.at["http://e1"] = 2
    pull = puller(q, client, tmp_path / "node")

    class Crash(Exception):
        pass

    real = q.storage.publish

    def crashing(key: str, data: bytes) -> None:
        if key.startswith("weights/manifest-"):
            raise Crash("killed before the manifest")
        real(key, data)

    monkeypatch.setattr(q.storage, "publish", crashing)
    w3 = shards(tmp_path, 3, **{**BASE, "a.safetensors": b"3" * 4000})
    with pytest.raises(Crash):
        bracket.publish_weights(lambda v: w3)
    monkeypatch.setattr(q.storage, "publish", real)
    assert len(published(tmp_path)) == 3  # the delta of 3 is written, named by nothing
    assert store.manifest(3) is None and q.current_version() == 2
    assert store.newest() == store.manifest(2)
    asyncio.run(settle(pull))
    assert client.loads == []
    # the restarted trainer publishes version 3 again: a new delta; the orphan is swept
    m3 = bracket.publish_weights(lambda v: w3, version=3).published
    assert m3 is not None and m3.is_delta and q.current_version() == 3
    assert sorted(published(tmp_path)) == sorted(os.path.basename(m.path)
                                                 for m in store.kept())
    asyncio.run(settle(pull))
    assert [v for _, v, _ in client.loads] == [3]


def test_a_producer_loads_a_delta_from_its_weights_cache_dir(tmp_path: Path) -> None:
    """A producer's engines (local sim engines) load version 2, a delta, from the directory
    the producer built under ``engine.weights_cache_dir``; version 1, full, from where it
    was published."""
    q, bracket = rolling(tmp_path)
    sim = SimConfig(time_scale=0.2, len_median=20, len_sigma=0.5, len_cap=60, cap_prob=0.0)
    engines = [EngineThread(EngineOptions(kind="sim", max_running=8, weight_version="0",
                                          sim=sim)) for _ in range(2)]
    cache = tmp_path / "node-cache"
    p = Producer(ProducerConfig(
        run_dir=str(tmp_path / "run"),
        engine=EngineConfig(workers=tuple(e.url for e in engines), backoff_s=0.05,
                            weights_cache_dir=str(cache)),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))

    def loaded(url: str) -> str:
        with urllib.request.urlopen(f"{url}/model_info", timeout=5) as r:
            return str(json.loads(r.read())["model_path"])

    async def body() -> None:
        m1 = bracket.publish_weights(lambda v: shards(tmp_path, v, **BASE)).published
        await wait_for(lambda: p.stats().rolling_loads == 2, 30, "version 1 loaded")
        assert m1 is not None and {loaded(e.url) for e in engines} == {m1.path}
        m2 = bracket.publish_weights(
            lambda v: shards(tmp_path, v, **{**BASE, "a.safetensors": b"2" * 4000})).published
        assert m2 is not None and m2.is_delta
        await wait_for(lambda: p.stats().rolling_loads == 4, 30, "version 2 loaded")
        paths = {loaded(e.url) for e in engines}
        assert len(paths) == 1 and paths.pop().startswith(str(cache))

    try:
        asyncio.run(run_producers([p], body))
    finally:
        for e in engines:
            e.stop()
    assert p.stats().rolling_load_failures == 0


def test_a_changed_local_build_of_the_base_is_refused_not_loaded(tmp_path: Path) -> None:
    q, bracket = _three_versions(tmp_path)
    store = WeightStore(q.storage)
    m2 = store.manifest(2)
    assert m2 is not None
    built2 = store.materialize(m2, tmp_path / "node")
    inherited = Path(built2, "b.safetensors")  # version 3 takes it from version 2
    inherited.unlink()
    inherited.write_bytes(b"x" * 4000)
    bracket.publish_weights(
        lambda v: shards(tmp_path, v, **{**BASE, "a.safetensors": b"3" * 4000}))
    m3 = store.manifest(3)
    assert m3 is not None and m3.base == 2
    with pytest.raises(DeltaRefused, match="checksum"):
        store.materialize(m3, tmp_path / "node")
    assert sorted(n for n in os.listdir(tmp_path / "node")) == [os.path.basename(built2)]


def test_a_producer_prunes_its_older_builds_and_unfinished_ones(tmp_path: Path) -> None:
    for name in ("v1-" + "a" * 16, "v2-" + "b" * 16, "v3-" + "c" * 16, ".v3-0123.tmp",
                 "other"):
        (tmp_path / name).mkdir()
    assert prune(tmp_path, 2) == 2
    assert sorted(os.listdir(tmp_path)) == ["other", "v2-" + "b" * 16, "v3-" + "c" * 16]


def test_weights_that_do_not_exist_are_refused_as_a_conflict(tmp_path: Path) -> None:
    q, bracket = rolling(tmp_path)
    with pytest.raises(WeightsConflict, match="do not exist"):
        WeightStore(q.storage).publish(1, tmp_path / "nowhere", wave=1, max_lag=1)
    with pytest.raises(DeltaRefused, match="not a directory"):
        bracket.publish_weights(lambda v: str(tmp_path / "nowhere"))
    assert q.current_version() == 0 and WeightStore(q.storage).newest() is None
