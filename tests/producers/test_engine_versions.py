"""Engines on the right weights: an engine on a version other than the run's is kept out of
rotation, noted in engines/, brought back by the trainer's push path, and no trained sample
carries a token generated on the wrong weights.

Each scenario releases prompts in phases: every group released after the engine went wrong
must hold tokens of the run's version only (before the guard, about half of them came from
the stale engine)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest

from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.demo.trainer import GRPOTrainer
from strawq.producers.engine_versions import NoFreshEngine, StaleEngine, VersionGuard
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.tiny_config import TinyConfig
from strawq.producers.engines.tiny_model import init_model
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
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.sglang_protocol import GenerateResult
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control
from strawq.weights.engine_weights import EngineWeights
from tests.producers.faulty_proxy import FaultyProxy
from tests.producers.helpers import make_run, ready_groups, run_producers, wait_for
from tests.sglang_fixtures import start_router

pytestmark = pytest.mark.timeout(120)

#: ~2 ms per decode step, ~20 tokens a response: phases last long enough to overlap
SIM = SimConfig(time_scale=0.2, len_median=20, len_sigma=0.5, len_cap=60, cap_prob=0.0)
TINY = TinyConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                  intermediate_size=32, context_length=128, seed=1)
PHASE = 12


def sim(version: str, port: int = 0) -> EngineThread:
    return EngineThread(EngineOptions(kind="sim", max_running=64, weight_version=version,
                                      sim=SIM), port=port)


def port_of(url: str) -> int:
    return int(urlparse(url).port or 0)


def release(q: RunQueue, run_dir: str, n: int) -> None:
    Feeder(q, Dataset(os.path.join(run_dir, "dataset.jsonl"))).release(n)


def producer(run_dir: str, workers: tuple[str, ...], *, hold: bool | None = None) -> Producer:
    """``hold``: ``timing.hold_through_pause`` (None, the default: hold, the journal on)."""
    return Producer(ProducerConfig(
        run_dir=run_dir,
        engine=EngineConfig(workers=workers, backoff_s=0.05),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        sampling=SamplerParams(max_new_tokens=40, seed=1),
        budget=BudgetConfig(slots=4),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02, hold_through_pause=hold)))


def versions_by_index(q: RunQueue) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for tid, grp in ready_groups(q).items():
        vs: set[int] = set()
        for i in range(len(grp.sample_lens)):
            vs |= set(np.asarray(grp.sample(i)["versions"]).tolist())
        out[int(tid.lstrip("i"))] = vs
    return out


def phased_run(run_dir: str, n: int, version: int) -> RunQueue:
    """A run at ``version`` with ``n`` prompts in its dataset, none released yet."""
    q = make_run(run_dir, 0, rows=[], group_size=2, release_batch=PHASE)
    with open(os.path.join(run_dir, "dataset.jsonl"), "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": [5 + i % 50, 9, 11], "target": 7, "count": 3}) + "\n")
    q.set_version(version)
    return q


def test_engine_restarted_on_an_old_version_is_kept_out_and_repaired(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    q = phased_run(run_dir, 3 * PHASE, 3)
    notes = EngineWeights(q.storage)
    bracket = WeightUpdateBracket(q)
    good = sim("3")
    bad = sim("3")
    port = port_of(bad.url)
    p = producer(run_dir, (good.url, bad.url))
    trainer = GRPOTrainer(init_model(TINY), str(tmp_path / "weights"), [good.url, bad.url])
    trainer.save(3)  # the weights of the run's version, as the last update left them
    restarted: list[EngineThread] = []

    async def body() -> None:
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) >= PHASE // 2, 60, "phase 1")
        bad.stop()  # the engine restarts on an old checkpoint, --weight-version 1
        restarted.append(sim("1", port=port))
        release(q, run_dir, PHASE)
        await wait_for(lambda: bool(notes.notes()), 60, "the stale engine noted")
        assert not p.guard.serves(bad.url)
        need = bracket.engines_needing_weights()
        assert set(need) == {bad.url} and need[bad.url].engine_version == 1
        assert need[bad.url].run_version == 3
        assert await asyncio.to_thread(bracket.repair_engines,
                                       trainer.repair_engines) == [bad.url]
        await wait_for(lambda: p.guard.serves(bad.url), 30, "the engine back in rotation")
        assert not notes.notes()
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) == 3 * PHASE, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
    finally:
        good.stop()
        for e in restarted:
            e.stop()
    found = versions_by_index(q)
    wrong = {i: v for i, v in found.items() if v != {3}}
    assert not wrong, f"groups with tokens of the wrong weights: {wrong}"
    st = p.stats()
    assert st.engines_marked_stale == 1 and st.engines_restored == 1
    assert st.stale_replies >= 1 and st.engines_stale == 0 and not st.waiting_for_weights


def test_failed_push_to_one_of_two_engines(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    n = 2 * PHASE
    q = phased_run(run_dir, n, 1)
    good, bad_engine = sim("1"), sim("1")
    proxy = FaultyProxy(bad_engine.url)  # refuses weight updates while ``refuse`` is set
    bad = proxy.url
    trainer = GRPOTrainer(init_model(TINY), str(tmp_path / "weights"), [good.url, bad])
    bracket = WeightUpdateBracket(q, lease_timeout_s=3.0, poll_interval_s=0.02,
                                  repair=trainer.repair_engines, repair_interval_s=0.2)
    p = producer(run_dir, (good.url, bad))
    assert len(versions_by_index(q)) == 0

    async def body() -> None:
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) >= PHASE, 60, "phase 1")
        proxy.refuse = {"/update_weights_from_disk"}
        await asyncio.to_thread(bracket.begin_weight_update, 30.0)
        await asyncio.to_thread(trainer.push_weights, 2)  # refused by one engine: tolerated
        assert trainer.failed_engines == [bad]
        await asyncio.to_thread(bracket.end_weight_update, 2)
        await wait_for(lambda: bad in p.guard.stale, 30, "the engine the push missed")
        release(q, run_dir, PHASE)
        await wait_for(lambda: bad in bracket.engines_needing_weights(), 30, "the note")
        proxy.refuse = set()  # the bracket's repair thread gets through now
        await wait_for(lambda: p.guard.serves(bad), 30, "the engine back in rotation")
        await wait_for(lambda: len(versions_by_index(q)) == n, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
    finally:
        bracket.close()
        proxy.stop()
        good.stop()
        bad_engine.stop()
    found = versions_by_index(q)
    late = {i: v for i, v in found.items() if i >= PHASE and v != {2}}
    assert not late, f"groups released after the update with tokens of version 1: {late}"
    assert not bracket.engines_needing_weights()


def _reply(version: int, spans: list[int], url: str = "http://e1") -> GenerateResult:
    n = len(spans)
    return GenerateResult(rid="r", output_ids=np.arange(n, dtype=np.int32),
                          logprobs=np.zeros(n, np.float32), versions=np.asarray(spans, np.int64),
                          finish_reason={"type": "length"}, weight_version=version,
                          completion_tokens=n, prompt_tokens=1, cached_tokens=0,
                          num_retractions=0, text="", url=url, meta_info={})


class _Client:
    worker_urls = ["http://e1", "http://e2"]
    router_url = None

    #: what each engine reports now (e1 stayed on 5; e2 was updated to 6)
    versions = {"http://e1": 5, "http://e2": 6}

    async def weight_version(self, url: str) -> int:
        return self.versions[url]


def test_a_mismatch_is_judged_only_outside_a_bracket(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"), 0, rows=[], group_size=2)
    q.set_version(5)
    control = Control(q.storage)
    notes = EngineWeights(q.storage)
    book = StatsBook(ProducerStats())

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    guard = VersionGuard("p1", client=_Client, current_version=q.current_version, notes=notes,
                         io=io, pausing=lambda: False, book=book)

    async def main() -> None:
        await guard.check(_reply(5, [5, 5]))  # the run's version: applied
        control.pause(6)  # a bracket: engines are updated one by one
        await guard.check(_reply(6, [5, 6]))
        await guard.check(_reply(5, [5]))
        assert not guard.stale and not notes.notes()
        control.resume(6)
        q.set_version(6)
        await guard.check(_reply(6, [6]))  # the guard re-reads the run's version
        with pytest.raises(StaleEngine):  # behind after the bracket: out, noted
            await guard.check(_reply(5, [5, 5, 5]))
        assert not guard.serves("http://e1") and guard.usable(_Client.worker_urls) == [
            "http://e2"]
        assert [n.url for n in notes.notes()] == ["http://e1"]
        with pytest.raises(StaleEngine):  # the right label, tokens of another: discarded
            await guard.check(_reply(6, [5, 6], url="http://e2"))
        with pytest.raises(StaleEngine):  # an old reply from an engine on 6 now: not marked
            await guard.check(_reply(5, [5], url="http://e2"))
        assert guard.serves("http://e2") and len(notes.notes()) == 1
        guard.stale["http://e2"] = 5
        with pytest.raises(NoFreshEngine):
            guard.usable(_Client.worker_urls)
        assert guard.waiting and guard.all_stale()

    asyncio.run(main())
    st = book.snapshot()
    assert st.stale_replies == 3 and st.stale_tokens_discarded == 6


def _new_worker_behind_router(tmp_path: Path, start_router: Callable[[str], Any]) -> None:
    """The router hides which worker answered: a mismatch makes the producer re-read the
    router's workers and probe each one; the new worker is noted and repaired, and no token
    of its old weights is trained (the router keeps routing to it meanwhile: those replies
    are discarded and re-issued)."""
    run_dir = str(tmp_path / "run")
    q = phased_run(run_dir, 2 * PHASE, 2)
    a, new = sim("2"), sim("0")
    router = start_router(a.url)
    bracket = WeightUpdateBracket(q)
    p = Producer(ProducerConfig(
        run_dir=run_dir,
        engine=EngineConfig(router_url=router.url, backoff_s=0.05),
        plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
        sampling=SamplerParams(max_new_tokens=40, seed=1),
        budget=BudgetConfig(slots=4),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))

    def push_to(urls: list[str], version: int) -> None:
        async def go() -> None:
            async with SGLangClient(urls) as c:
                await c.push_weights("/sim/w", weight_version=version)
        asyncio.run(go())

    async def body() -> None:
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) >= 2, 60, "phase 1")
        async with SGLangClient([router.url]) as c:  # a new worker joins on old weights
            await c.transport.call_raw("POST", router.url, "/workers",
                              body={"url": new.url, "worker_type": "regular"}, timeout_s=10)
        release(q, run_dir, PHASE)
        await wait_for(lambda: new.url in bracket.engines_needing_weights(), 60, "the note")
        assert await asyncio.to_thread(bracket.repair_engines, push_to) == [new.url]
        await wait_for(lambda: not p.guard.stale, 30, "the worker back")
        await wait_for(lambda: len(versions_by_index(q)) == 2 * PHASE, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
    finally:
        router.stop()
        a.stop()
        new.stop()
    wrong = {i: v for i, v in versions_by_index(q).items() if v != {2}}
    assert not wrong, f"groups with tokens of the new worker's old weights: {wrong}"
    assert p.stats().stale_replies >= 1


def test_a_new_worker_on_old_weights_behind_the_router(tmp_path: Path) -> None:
    _new_worker_behind_router(tmp_path, lambda url: EngineThread(
        EngineOptions(kind="router", worker_urls=(url,))))


@pytest.mark.sglang_real
def test_a_new_worker_on_old_weights_behind_the_real_router(
        tmp_path: Path, sglang_router_cmd: list[str]) -> None:
    """The same behind the real sglang-router 0.3.x (round robin, workers added live)."""
    _new_worker_behind_router(tmp_path, lambda url: start_router(
        sglang_router_cmd, [url], log=tmp_path / "router.log"))


def test_a_trainer_dead_after_its_push_is_finished_from_the_command_line(
        tmp_path: Path) -> None:
    """The trainer paused for version 4, pushed it to every engine and died: an abort would
    put the run back on 3 and every producer would keep every engine out of rotation (and
    generate nothing); ``strawq bracket finish`` announces 4 instead, found from the engines
    the producer registered, and generation goes on with version-4 tokens only."""
    from strawq.app import cli

    run_dir = str(tmp_path / "run")
    q = phased_run(run_dir, 2 * PHASE, 3)
    a, b = sim("3"), sim("3")
    p = producer(run_dir, (a.url, b.url))
    dead = WeightUpdateBracket(q, lease_timeout_s=3.0, poll_interval_s=0.02)

    async def body() -> None:
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) >= PHASE // 2, 60, "phase 1")
        await asyncio.to_thread(dead.begin_weight_update, 30.0)
        push = SGLangClient([a.url, b.url])
        await push.start()
        try:
            await push.update_weight_version(4)  # every engine holds 4; the trainer dies
        finally:
            await push.close()
        assert await asyncio.to_thread(cli.main, ["bracket", "abort", run_dir]) == 1
        assert await asyncio.to_thread(cli.main, ["bracket", "finish", run_dir]) == 0
        assert set(EngineWeights(q.storage).known()) == {a.url, b.url}  # the producer's
        release(q, run_dir, PHASE)
        await wait_for(lambda: len(versions_by_index(q)) == 2 * PHASE, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
    finally:
        a.stop()
        b.stop()
    assert q.current_version() == 4
    late = {i: v for i, v in versions_by_index(q).items() if i >= PHASE and v != {4}}
    assert not late, f"groups released after the update without version-4 tokens: {late}"
    st = p.stats()
    assert st.engines_marked_stale == 0 and not st.waiting_for_weights
    assert not EngineWeights(q.storage).notes()


def test_a_dead_producers_note_is_cleared_by_the_next_probe_that_finds_the_engine_fine(
        tmp_path: Path) -> None:
    """A producer noted an engine and died; the engine was fixed meanwhile. The next
    producer's probe finds it on the run's version and deletes the note (the metric
    ``engines/needing_weights`` drops) without any push or ``forget-engine``; a note on
    an engine still behind stays."""
    run_dir = str(tmp_path / "run")
    q = phased_run(run_dir, PHASE, 3)
    fixed, behind = sim("3"), sim("2")
    notes = EngineWeights(q.storage)
    notes.mark(fixed.url, writer="p-dead", engine_version=2, run_version=3, reason="r")
    notes.mark(behind.url, writer="p-dead", engine_version=2, run_version=3, reason="r")
    p = producer(run_dir, (fixed.url, behind.url))

    async def body() -> None:
        release(q, run_dir, PHASE)
        await wait_for(lambda: set(notes.needing()) == {behind.url}, 30, "the fixed one")
        assert set(notes.known()) == {fixed.url, behind.url}
        assert not p.guard.serves(behind.url)
        # the engine behind is fixed by hand; the producer's probe clears every note on it
        fixer = SGLangClient([behind.url])
        await fixer.start()
        try:
            await fixer.update_weight_version(3)
        finally:
            await fixer.close()
        await wait_for(lambda: not notes.notes(), 30, "every note cleared")
        await wait_for(lambda: len(versions_by_index(q)) == PHASE, 60, "every group")

    try:
        asyncio.run(run_producers([p], body))
    finally:
        fixed.stop()
        behind.stop()
    assert not notes.needing()
