"""The reader's weight-update calls take what the bracket's take (issue 39): a fingerprint
for ``reader.weight_update`` (rank 0 publishes it, every engine is checked against it), and
the update's mode, rolling and delta settings for ``reader.configure_bracket`` (configured
once, as its other options)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from strawq.collector.trainer.reader import BatchReader
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import sim_weights
from strawq.producers.engines.testing import EngineThread
from strawq.producers.sglang_client import SGLangClient
from strawq.weights.fingerprint import Fingerprints, fingerprint_of
from strawq.weights.publish import WeightStore
from tests.collector.helpers import make_run

pytestmark = pytest.mark.timeout(60)


def _load(url: str, path: str, version: int) -> None:
    async def go() -> None:
        async with SGLangClient([url]) as c:
            await c.push_weights(path, weight_version=version, url=url)

    asyncio.run(go())


def test_reader_weight_update_publishes_the_fingerprint_on_rank_0_and_attests(
        tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"))
    engine = EngineThread(EngineOptions(kind="sim", weight_version="0"))
    try:
        readers = [BatchReader(q, rank=r, world_size=2) for r in range(2)]
        readers[0].bracket.engine_urls = [engine.url]  # the engines it checks
        good = fingerprint_of(sim_weights(str(tmp_path / "w1")), dtype="float32")
        reports = [r.weight_update(lambda v: _load(engine.url, str(tmp_path / "w1"), v),
                                   timeout=5, fingerprint=good) for r in readers]
        assert reports[0] is not None and reports[0].version == 1 and reports[1] is None
        book = Fingerprints(q.storage)
        assert book.get(1) == good  # published once, by rank 0
        assert book.verdicts(1)[engine.url].ok  # the engine was checked against it
        # an engine that loaded other weights than the fingerprint's fails its check
        other = fingerprint_of(sim_weights(str(tmp_path / "elsewhere")), dtype="float32")
        readers[0].weight_update(lambda v: _load(engine.url, str(tmp_path / "w2"), v),
                                 timeout=5, fingerprint=other)
        assert book.get(2) == other and not book.verdicts(2)[engine.url].ok
    finally:
        engine.stop()


def test_configure_bracket_takes_the_rolling_and_delta_settings_once(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"), group_size=2)
    reader = BatchReader(q)
    publish = str(tmp_path / "published")
    bracket = reader.configure_bracket(weight_update="rolling", wave=2, max_lag=2,
                                       publish_dir=publish, max_delta_chain=1,
                                       engine_urls=["http://e1/"])
    pub = bracket.publisher
    assert (bracket.mode, pub.wave, pub.max_lag, pub.publish_dir, pub.max_delta_chain) == (
        "rolling", 2, 2, publish, 1)
    assert bracket.engine_urls == ["http://e1"]
    assert reader.bracket is bracket
    assert reader.configure_bracket(weight_update="rolling", wave=2, max_lag=2,
                                    publish_dir=publish, max_delta_chain=1,
                                    engine_urls=("http://e1/",)) is bracket
    with pytest.raises(ValueError, match="already built with .*publish_dir"):
        reader.configure_bracket(weight_update="rolling", wave=2, max_lag=2,
                                 publish_dir=str(tmp_path / "other"), max_delta_chain=1,
                                 engine_urls=["http://e1/"])
    with pytest.raises(ValueError, match="already built"):
        reader.configure_bracket()

    def write(v: int) -> str:  # one file changes per version, one stays
        d = tmp_path / "trainer" / f"v{v}"
        d.mkdir(parents=True)
        (d / "config.json").write_text('{"model": "x"}' + " " * 4000)
        (d / "model.bin").write_bytes(bytes([v]) * 100)
        return str(d)

    # the reader's rank-aware update publishes (nothing paused) under publish_dir, as a
    # delta while the chain allows (max_delta_chain=1: full, delta, full)
    for _ in range(3):
        rep = reader.weight_update(write)
        assert rep is not None and rep.published is not None
    store = WeightStore(q.storage)
    kinds = [(m.version, m.is_delta) for m in sorted(store.kept(), key=lambda m: m.version)]
    assert kinds[-3:] == [(1, False), (2, True), (3, False)]
    assert all(os.path.dirname(m.path) == os.path.realpath(publish) for m in store.kept())
    assert q.current_version() == 3


def test_a_fingerprint_in_the_rolling_mode_is_published_for_its_version(
        tmp_path: Path) -> None:
    """The rolling mode publishes the fingerprint given to its update as the version's
    (before the manifest: producers check each engine against it after its load)."""
    q = make_run(str(tmp_path / "run"), group_size=2)
    reader = BatchReader(q)
    reader.configure_bracket(weight_update="rolling", wave=1)
    d = tmp_path / "w1"
    d.mkdir()
    (d / "model.bin").write_bytes(b"1")
    fp = fingerprint_of(sim_weights(str(d)), dtype="float32")
    rep = reader.weight_update(lambda v: str(d), fingerprint=fp)
    assert rep is not None and rep.published is not None and q.current_version() == 1
    assert Fingerprints(q.storage).get(1) == fp


def test_configure_bracket_refuses_bad_rolling_settings(tmp_path: Path) -> None:
    reader = BatchReader(make_run(str(tmp_path / "run")))
    with pytest.raises(ValueError, match="max_delta_chain"):
        reader.configure_bracket(weight_update="rolling", max_delta_chain=-1)
    with pytest.raises(ValueError, match="weight_update must be one of"):
        reader.configure_bracket(weight_update="sideways")
    # a refused configuration builds nothing: the next one is the bracket
    assert reader.configure_bracket(weight_update="rolling").mode == "rolling"
