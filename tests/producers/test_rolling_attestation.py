"""Attestation in the rolling mode, end to end on the local sim engines: the trainer's
fingerprint of version v is published before v's manifest; each engine that pulled v is
checked against it before it serves; one that loaded the wrong checkpoint under the right
version label is refused (verdict recorded, out of rotation) and generates nothing more,
its work done by the others (strawq.producers.rolling, strawq.weights.fingerprint)."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.producers.engine_versions import StaleEngine
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import sim_weights
from strawq.producers.engines.testing import EngineThread
from strawq.producers.sglang_client import SGLangClient
from strawq.weights.engine_weights import EngineWeights
from strawq.weights.fingerprint import Fingerprints, Verdict, fingerprint_of
from strawq.weights.publish import WeightStore
from tests.producers.helpers import ready_groups, run_producers, wait_for
from tests.producers.test_rolling import (
    SIM,
    loader_pull,
    _producer,
    _reply,
    _run,
    _versions,
    weights,
)

pytestmark = pytest.mark.timeout(120)


def generated_tokens(url: str) -> int:
    with urllib.request.urlopen(f"{url}/strawq/live_requests", timeout=5) as r:
        return int(json.loads(r.read())["generated_tokens"])


def test_the_fingerprint_is_published_before_the_manifest(tmp_path: Path) -> None:
    """While ``write(v)`` runs, v's fingerprint exists and its manifest not yet: no engine
    can load v before the fingerprint it is checked against is there."""
    q = _run(str(tmp_path / "run"), 2)
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1)
    fp = fingerprint_of(sim_weights(weights(tmp_path, 9)), dtype="float32")
    seen: list[tuple[bool, bool]] = []

    def write(v: int) -> str:
        seen.append((Fingerprints(q.storage).get(v) is not None,
                     WeightStore(q.storage).manifest(v) is not None))
        return weights(tmp_path, 9)

    rep = bracket.weight_update(write, fingerprint=fp)
    assert seen == [(True, False)]
    assert rep.published is not None and Fingerprints(q.storage).get(rep.version) == fp


def _rolling_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 wrong: bool) -> dict[str, Any]:
    """Three sim engines on version 0; half the groups, a rolling update to version 1 with
    its fingerprint, the other half. With ``wrong``, the last engine loads other weights
    than the published ones under the label 1."""
    run_dir = str(tmp_path / "run")
    n = 24
    q = _run(run_dir, n)
    engines = [EngineThread(EngineOptions(kind="sim", max_running=64, weight_version="0",
                                          sim=SIM)) for _ in range(3)]
    bad = engines[-1].url
    other = weights(tmp_path, 7, body=b"another checkpoint" * 4)
    at_wrong_load: list[int] = []
    push = SGLangClient.push_weights

    async def push_weights(self: SGLangClient, model_path: str, *, weight_version: int,
                           url: str | None = None, **kw: Any) -> dict[str, Any]:
        if wrong and url == bad:
            out = await push(self, other, weight_version=weight_version, url=url, **kw)
            if not at_wrong_load:
                at_wrong_load.append(await asyncio.to_thread(generated_tokens, bad))
            return out
        return await push(self, model_path, weight_version=weight_version, url=url, **kw)

    monkeypatch.setattr(SGLangClient, "push_weights", push_weights)
    p = _producer(run_dir, tuple(e.url for e in engines))
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=3, max_lag=1)
    data = os.path.join(run_dir, "dataset.jsonl")

    def write(v: int) -> str:
        return weights(tmp_path, v)

    async def body() -> None:
        Feeder(q, Dataset(data)).release(n // 2)
        await wait_for(lambda: p.stats().tokens_generated > 50, 60, "generation under way")
        fp = fingerprint_of(sim_weights(weights(tmp_path, 1)), dtype="float32")
        await asyncio.to_thread(bracket.weight_update, write, fingerprint=fp)
        await wait_for(lambda: p.stats().rolling_loads == (2 if wrong else 3), 60,
                       "the engines loaded")
        if wrong:
            await wait_for(lambda: bad in p.rolling.refused, 60, "the wrong engine refused")
        Feeder(q, Dataset(data)).release(n // 2)
        await wait_for(lambda: len(ready_groups(q)) == n, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
        final = {e.url: generated_tokens(e.url) for e in engines}
    finally:
        for e in engines:
            e.stop()
    return {"q": q, "p": p, "urls": [e.url for e in engines], "bad": bad, "final": final,
            "at_wrong_load": at_wrong_load, "n": n}


def test_an_engine_on_the_wrong_checkpoint_under_the_right_label_serves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = _rolling_run(tmp_path, monkeypatch, wrong=True)
    q, p, bad = r["q"], r["p"], r["bad"]
    verdicts = Fingerprints(q.storage).verdicts(1)
    assert verdicts[bad].ok is False and verdicts[bad].found != verdicts[bad].expected
    assert all(verdicts[u].ok for u in r["urls"] if u != bad)
    assert p.rolling.refused.get(bad) == 1 and not p.guard.serves(bad)
    # marked as the bracket mode marks an engine that failed: a reply from it is refused
    assert bad in p.guard.stale and bad in EngineWeights(q.storage).needing()
    # not one token generated on the wrong weights: nothing was sent to it after its load
    assert len(r["at_wrong_load"]) == 1 and r["final"][bad] == r["at_wrong_load"][0]
    st = p.stats()
    assert st.rolling_load_failures >= 1 and st.groups_dropped == 0
    assert len(ready_groups(q)) == r["n"]  # its share regenerated on the other engines
    assert any(1 in s for s in _versions(q))


def test_every_engine_that_loads_the_published_weights_attests_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = _rolling_run(tmp_path, monkeypatch, wrong=False)
    q, p = r["q"], r["p"]
    verdicts = Fingerprints(q.storage).verdicts(1)
    assert sorted(verdicts) == sorted(r["urls"]) and all(v.ok for v in verdicts.values())
    st = p.stats()
    assert st.rolling_loads == 3 and st.rolling_load_failures == 0 and not p.rolling.refused
    assert set(p.guard.versions.values()) == {1}
    assert st.groups_dropped == 0 and st.stale_replies == 0
    assert any(1 in s for s in _versions(q))


def _guarded_puller(tmp_path: Path, at: int, after_load: Any = None) -> tuple[Any, ...]:
    """A run at version 1 published with a fingerprint, two fake engines labelled ``at``,
    and a producer's guard and puller over them."""
    fp = fingerprint_of(sim_weights(weights(tmp_path, 1)), dtype="float32")
    q, _b, client, _book, guard, pull = loader_pull(tmp_path, wave=2, after_load=after_load,
                                                     fingerprint=fp, at=at)
    return q, fp, client, guard, pull


def test_an_engine_found_on_the_version_without_a_passing_verdict_is_loaded_again(
        tmp_path: Path) -> None:
    """A producer (re)started while its engines already report version 1: the one with a
    passing verdict at 1 stays; the one without (its check never recorded) is loaded again
    and checked, never put to work on the label alone."""
    checked: list[str] = []

    async def after_load(url: str, version: int) -> None:
        checked.append(url)

    q, fp, client, guard, pull = _guarded_puller(tmp_path, 1, after_load)
    book = Fingerprints(q.storage)
    book.record(Verdict("http://e1", 1, True, fp.digest, fp.digest))

    async def main() -> None:
        await pull.step()
        await asyncio.gather(*pull.pulls.values())
        await pull.step()
        assert not pull.pulls

    asyncio.run(main())
    assert client.loads == [("http://e2", 1)] and checked == ["http://e2"]


def test_a_reply_from_an_engine_refused_after_its_rolling_load_is_refused(
        tmp_path: Path) -> None:
    """The check after the load failed: the engine is marked in the guard (and engines/),
    so a reply it sends on the version it claims is refused, its tokens regenerated."""
    async def after_load(url: str, version: int) -> None:
        if url == "http://e2":
            raise ValueError("fingerprint mismatch")

    q, _, client, guard, pull = _guarded_puller(tmp_path, 0, after_load)

    async def main() -> None:
        await pull.step()
        await asyncio.gather(*pull.pulls.values())
        assert "http://e2" in guard.stale and "http://e2" in guard.loading
        await guard.check(_reply(1, [1, 1], "http://e1"))  # attested: applied
        with pytest.raises(StaleEngine, match="failed attestation|not attested"):
            await guard.check(_reply(1, [1, 1], "http://e2"))

    asyncio.run(main())
    assert "http://e2" in EngineWeights(q.storage).needing()


def test_a_probe_does_not_mark_an_engine_within_the_lag_as_not_attested(
        tmp_path: Path) -> None:
    """Version 1 has a fingerprint; an engine still on version 0 (within the lag, not yet
    pulled) serves on: the check at version 1 is for engines that report version 1."""
    q, fp, client, guard, _ = _guarded_puller(tmp_path, 0)
    client.at["http://e1"] = 1
    Fingerprints(q.storage).record(Verdict("http://e1", 1, True, fp.digest, fp.digest))

    async def main() -> None:
        await guard.probe_all()
        assert guard.stale == {} and guard.lag == 1

    asyncio.run(main())
