"""The Producer loop without Ray: a real run directory and an in-process sim engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.handback import MisconfiguredProducer
from strawq.producers.producer import Producer
from strawq.producers.producer_config import EngineConfig, PluginsConfig, ProducerConfig
from strawq.producers.sglang_client import SGLangClient
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control
from tests.producers.conftest import FAST_SIM
from tests.producers.helpers import (
    config_with,
    ids,
    make_run,
    names,
    ready_groups,
    run_producers,
    wait_for,
)

pytestmark = pytest.mark.timeout(90)

PLUGINS = "tests.producers.plugins_for_tests"


def config(run: Path, eng: Any, **sections: Any) -> ProducerConfig:
    """A producer of ``run`` on ``eng``; ``sections`` override keys section by section."""
    base: dict[str, Any] = {"run_dir": str(run), "engine": {"workers": (eng.url,)},
                            "plugins": {"reward": f"{PLUGINS}.length_reward"},
                            "budget": {"slots": 3}, "sampling": {"max_new_tokens": 64, "seed": 7},
                            "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}}
    return config_with(base, sections)


def all_settled(q: RunQueue, n: int) -> bool:
    return len(ids(q, "ready")) + len(ids(q, "dropped")) == n


def test_groups_become_ready_exactly_once(tmp_path: Path, sim_engine: Any) -> None:
    n = 24
    q = make_run(str(tmp_path / "run"), n)
    p = Producer(config(tmp_path / "run", sim_engine))
    seen_busy: list[int] = []

    async def body() -> None:
        async def watch() -> None:
            while True:
                seen_busy.append(p.stats().busy_trajectories)
                await asyncio.sleep(0.005)
        w = asyncio.create_task(watch())
        await wait_for(lambda: all_settled(q, n), 60, "all groups ready")
        w.cancel()

    asyncio.run(run_producers([p], body))
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    assert not ids(q, "pending") and not ids(q, "leased")
    assert max(seen_busy) <= 3 * 4  # never more trajectories than slots * G
    for g in ready_groups(q).values():
        assert g.num_samples == 4
        assert all(s in ("completed", "truncated") for s in g.status)
        assert g.rewards == [float(x) for x in g.sample_lens]  # length_reward
        assert max(g.sample_lens) <= 64
        assert g.meta["producer"] == p.producer_id
    st = p.stats()
    assert st.groups_completed == n and st.groups_done == n
    assert st.cpu_s_per_group is not None and 0 < st.slot_utilisation <= 1.0


def test_string_prompts_need_a_tokenizer(tmp_path: Path, sim_engine: Any) -> None:
    rows = [{"prompt": "hello world"}, {"prompt": [5, 6, 7]}]
    q = make_run(str(tmp_path / "a"), 0, rows=rows)
    p = Producer(config(tmp_path / "a", sim_engine))
    with pytest.raises(MisconfiguredProducer, match="refuses to start.*plugins.tokenizer"):
        asyncio.run(p.run())  # the first task is text: nothing claimed, nothing dropped
    assert ids(q, "pending") == ["i000000000000", "i000000000001"] and not ids(q, "dropped")

    q2 = make_run(str(tmp_path / "b"), 0, rows=rows)
    p2 = Producer(config(tmp_path / "b", sim_engine,
                         plugins={"tokenizer": f"{PLUGINS}.char_tokenizer"}))
    asyncio.run(run_producers([p2], lambda: wait_for(lambda: all_settled(q2, 2), 30, "ready")))
    assert ids(q2, "ready") == ["i000000000000", "i000000000001"]
    g = ready_groups(q2)["i000000000000"]
    assert g.prompt_ids.tolist() == [3 + ord(c) % 100 for c in "hello world"]


def test_reward_errors_are_recorded_not_raised(tmp_path: Path, sim_engine: Any) -> None:
    rows = [{"prompt": [4, 5]}, {"prompt": [6, 7], "boom": True}, {"prompt": [8, 9]}]
    q = make_run(str(tmp_path / "run"), 0, rows=rows)
    p = Producer(config(tmp_path / "run", sim_engine,
                        plugins={"reward": f"{PLUGINS}.flaky_reward"}))
    asyncio.run(run_producers([p], lambda: wait_for(lambda: all_settled(q, 3), 30, "settled")))
    ready = ready_groups(q)
    assert sorted(ready) == ["i000000000000", "i000000000002"]
    for g in ready.values():
        assert g.status[0] == "failed" and g.rewards[0] is None
        assert "verifier crashed" in g.meta["reward_errors"]["0"]
        assert g.rewards[1:] == [1.0, 2.0, 3.0]
    (dropped,) = names(q, "dropped")  # every reward failed: nothing to learn from
    assert dropped.id == "i000000000001" and dropped.producer == "reward_error"
    assert p.stats().reward_errors == 1 + 1 + 4


def test_filter_drops_and_frees_capacity(tmp_path: Path, sim_engine: Any) -> None:
    n = 10
    q = make_run(str(tmp_path / "run"), n)
    p = Producer(config(tmp_path / "run", sim_engine,
                        plugins={"reward": f"{PLUGINS}.constant_reward",
                                 "filter": "strawq.producers.rewards.zero_variance"},
                        budget={"slots": 1}))
    asyncio.run(run_producers([p], lambda: wait_for(lambda: all_settled(q, n), 30, "dropped")))
    dropped = names(q, "dropped")
    assert len(dropped) == n and {t.producer for t in dropped} == {"zero_variance"}
    st = p.stats()
    assert st.groups_dropped == n and st.drop_reasons == {"zero_variance": n}
    assert st.busy_trajectories == 0


def test_slots_zero_claims_nothing_until_set(tmp_path: Path, sim_engine: Any) -> None:
    q = make_run(str(tmp_path / "run"), 4)
    p = Producer(config(tmp_path / "run", sim_engine, budget={"slots": 0}))

    async def body() -> None:
        await asyncio.sleep(0.3)
        assert len(ids(q, "pending")) == 4 and p.stats().groups_claimed == 0
        p.set_slots(2)
        await wait_for(lambda: all_settled(q, 4), 30, "ready after set_slots")

    asyncio.run(run_producers([p], body))
    assert p.stats().slots == 2


@pytest.fixture
def paced_sim() -> Iterator[EngineThread]:
    """2 ms a decode step: a 300-token group takes 0.6 s, so a pause sent 30 ms into
    generation always lands mid-flight (the fast sim's 30 ms groups could finish first)."""
    with EngineThread(EngineOptions(kind="sim", max_running=64,
                                    sim=replace(FAST_SIM, time_scale=0.2))) as eng:
        yield eng


@pytest.mark.slow
def test_stop_yields_partials_that_another_producer_finishes(
        tmp_path: Path, paced_sim: EngineThread) -> None:
    """Stop mid-generation: held groups go back as partials; a second producer resumes
    them and the tokens equal an uninterrupted run's (seeded sim engine)."""
    sim_engine = paced_sim  # 0.8 s a group: the stop 50 ms in lands mid-generation
    n = 6
    rows = [{"prompt": [10 + i, 11, 12]} for i in range(n)]
    kw: dict[str, Any] = {"sampling": {"max_new_tokens": 400, "ignore_eos": True},
                          "budget": {"slots": 6}}
    # reference: uninterrupted
    qa = make_run(str(tmp_path / "a"), 0, rows=rows)
    pa = Producer(config(tmp_path / "a", sim_engine, **kw))
    asyncio.run(run_producers([pa], lambda: wait_for(lambda: all_settled(qa, n), 60, "ref")))
    ref = ready_groups(qa)

    qb = make_run(str(tmp_path / "b"), 0, rows=rows)
    p1 = Producer(config(tmp_path / "b", sim_engine, **kw))

    async def first() -> None:
        await wait_for(lambda: p1.stats().tokens_generated > 0 or
                       p1.stats().busy_trajectories > 0, 30, "work started")
        await asyncio.sleep(0.05)

    asyncio.run(run_producers([p1], first))
    assert p1.stats().groups_yielded >= 1
    partial = [t for t in names(qb, "pending") if t.key.startswith("a")]
    assert partial and all(t.resume >= 0 for t in partial)
    p2 = Producer(config(tmp_path / "b", sim_engine, **kw))
    asyncio.run(run_producers([p2], lambda: wait_for(lambda: all_settled(qb, n), 60, "b")))
    got = ready_groups(qb)
    assert sorted(got) == sorted(ref)
    for gid, g in got.items():
        assert g.sample_lens == [400] * 4
        assert np.array_equal(g.tokens, ref[gid].tokens)
        assert np.array_equal(g.logprobs, ref[gid].logprobs)


@pytest.mark.slow
@pytest.mark.parametrize("hold", [False, None], ids=["park", "hold-default"])
def test_bracket_on_sim_engine(tmp_path: Path, paced_sim: EngineThread,
                               hold: bool | None) -> None:
    """Pause/ack/resume twice: partials carry prefixes (or the groups are held through the
    pause, the default), versions step up, the off-policy prefix is masked, and nothing is
    lost or duplicated (tokens equal an unpaused run)."""
    n = 8
    rows = [{"prompt": [20 + i, 21]} for i in range(n)]
    kw: dict[str, Any] = {"sampling": {"max_new_tokens": 300, "ignore_eos": True},
                          "budget": {"slots": 2},
                          "record": {"mask_offpolicy_in_partial_rollout": True}}
    if hold is not None:
        kw["timing"] = {"hold_through_pause": hold}
    q = make_run(str(tmp_path / "run"), 0, rows=rows)
    control = Control(q.storage)
    sim_engine = paced_sim
    p = Producer(config(tmp_path / "run", sim_engine, **kw))

    async def body() -> None:
        async with SGLangClient([sim_engine.url]) as client:
            for v in (1, 2):
                await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
                await asyncio.sleep(0.03)
                control.pause(v)
                await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")
                # the ack: no lease held, or held through the pause, each one counted
                leased = names(q, "leased")
                assert len(leased) == control.held(v, p.producer_id)
                assert bool(leased) == (hold is None and bool(p.runner.groups))
                await client.update_weight_version(v, abort_all_requests=False)
                q.set_version(v)
                control.resume(v)
        await wait_for(lambda: all_settled(q, n), 60, "all ready")

    asyncio.run(run_producers([p], body))
    ready = ready_groups(q)
    assert len(ready) == n and p.stats().brackets == 2
    spans = 0
    for g in ready.values():
        assert g.sample_lens == [300] * 4
        for i in range(4):
            c = g.sample(i)
            v = c["versions"]
            assert np.all(np.diff(v) >= 0)
            assert np.array_equal(c["loss_mask"], (v == v.max()).astype(np.uint8))
            spans += int(v.min() != v.max())
    assert spans > 0
    st = p.stats()
    assert (st.groups_yielded, st.groups_held)[hold is None] >= 1
    assert (st.groups_held, st.groups_yielded)[hold is None] == 0


def test_config_is_in_sections() -> None:
    """Besides the run directory and the producer id, every key lives in a section that is
    a config class of its own (validated, documented, ``--set section.key=value``)."""
    import dataclasses

    from strawq.config import Config

    sections = {f.name for f in dataclasses.fields(ProducerConfig)} - {"run_dir", "producer_id"}
    assert sections == {"engine", "plugins", "sampling", "budget", "tools", "record", "timing",
                        "threads"}
    cfg = ProducerConfig.from_dict({"run_dir": "x", "plugins": {"reward": "a.b"},
                                    "engine": {"workers": ["http://u:1"]}})
    for name in sections:
        assert isinstance(getattr(cfg, name), Config), name
    assert cfg.sampling.max_new_tokens == 1024 and cfg.budget.slots == 1


def test_config_rejects_unknown_keys(tmp_path: Path) -> None:
    base = {"run_dir": "x", "plugins": {"reward": "a.b"}, "engine": {"workers": ["http://u:1"]}}
    with pytest.raises(ConfigError, match=r"ProducerConfig\.sampling: unknown key\(s\) "
                                          r"\['max_new_token'\]"):
        ProducerConfig.from_dict({**base, "sampling": {"max_new_token": 3}})
    with pytest.raises(ConfigError, match=r"ProducerConfig: unknown key\(s\) "
                                          r"\['max_new_tokens'\]; known keys are \[.*'sampling'"):
        ProducerConfig.from_dict({**base, "max_new_tokens": 3})  # a key outside its section
    cfg = ProducerConfig.from_dict({**base, "engine": {"workers": ["http://u:1"],
                                                       "client": {"max_retries": 1}}})
    assert cfg.engine.client.max_retries == 1 and cfg.engine.workers == ("http://u:1",)
    with pytest.raises(ConfigError, match="workers"):
        ProducerConfig(run_dir="x", engine=EngineConfig(),
                       plugins=PluginsConfig(reward="a.b"))
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['engine'\]"):
        ProducerConfig.from_dict({"run_dir": "x", "plugins": {"reward": "a.b"}})
    with pytest.raises(ConfigError, match="sampling_params"):
        cfg.sampler_params({"temprature": 1.0})


def test_a_producer_stops_by_itself_once_the_run_has_finished(
        tmp_path: Path, sim_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing is left and the collector published the ``finished`` record: ``run()``
    returns without ``request_stop`` (the CLI then exits 0). Its stop line at INFO is one
    short line; the whole stats dict goes to DEBUG."""
    from strawq.tasks.finished import mark_finished

    n = 4
    q = make_run(str(tmp_path / "run"), n)
    p = Producer(config(tmp_path / "run", sim_engine, timing={"idle_after_s": 0.1,
                                                             "idle_probe_s": 0.1}))

    async def body() -> None:
        task = asyncio.create_task(p.run())
        await wait_for(lambda: all_settled(q, n), 60, "all groups ready")
        mark_finished(q.storage, 0, 1)
        await asyncio.wait_for(task, 60)  # returns by itself: nobody asked it to stop

    with caplog.at_level("INFO", logger="strawq.producers.producer"):
        asyncio.run(body())
    infos = [r.getMessage() for r in caplog.records
             if r.levelname == "INFO" and r.name == "strawq.producers.producer"]
    assert any("the run has finished" in m for m in infos), infos
    stopped = [m for m in infos if " stopped: " in m]
    assert len(stopped) == 1 and len(stopped[0]) < 200, stopped
    assert f"{n} completed" in stopped[0]
