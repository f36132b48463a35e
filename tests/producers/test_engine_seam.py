"""The producer's engine path: any injected client is version-guarded, a segment deadline
keeps its tokens, the bracket aborts retried requests, a sample's failure aborts (not
cancels) its siblings, and EOS ids are resolved at start or the producer refuses to run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.producers.engine_errors import EngineUnavailable
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.eos import resolve_eos_ids
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    TimingConfig,
)
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sample_step import step_sample
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.weights.control import Control
from tests.producers.faulty_proxy import FaultyProxy
from tests.producers.helpers import ids, make_run, names, ready_groups, run_producers, wait_for
from tests.producers.journal_helpers import saved_prefix

pytestmark = pytest.mark.timeout(120)

REWARD = "strawq.producers.rewards.count_task"


def _config(run_dir: str, url: str, *, slots: int, sampling: SamplerParams,
            engine: dict[str, Any] | None = None, timing: dict[str, Any] | None = None
            ) -> ProducerConfig:
    """A producer on one engine that polls fast (the tests wait on it)."""
    return ProducerConfig(
        run_dir=run_dir, engine=EngineConfig(workers=(url,), **(engine or {})),
        plugins=PluginsConfig(reward=REWARD), budget=BudgetConfig(slots=slots),
        sampling=sampling,
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02, **(timing or {})))
#: 10 ms per token, every response exactly 60 tokens ending on EOS (id 2)
PACED = SimConfig(step_base_ms=10.0, len_median=60, len_sigma=0.0, len_cap=60, cap_prob=0.0)
#: 10 ms per token, responses that run to their budget
ENDLESS = SimConfig(step_base_ms=10.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)


class Delegating:
    """An engine client that is not an ``SGLangClient``: it hands every call to one."""

    def __init__(self, inner: SGLangClient) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": [5 + i, 9, 11 + i], "target": 7, "count": 3} for i in range(n)]


def versions_of(q: Any) -> set[int]:
    out: set[int] = set()
    for grp in ready_groups(q).values():
        out |= set(np.asarray(grp.versions).tolist())
    return out


def saved_partial(q: Any) -> Any:
    """The saved prefixes of the run's one task (handed back as a partial: its ``.partial``
    or the journal it was parked into)."""
    (t,) = names(q, "pending")
    group = saved_prefix(q, t)
    assert group is not None, f"task {t} has no saved prefix"
    return group


# -- every client is guarded -------------------------------------------------------------------
def test_an_injected_client_of_any_type_is_version_guarded(tmp_path: Path) -> None:
    """An engine that moves to other weights outside a bracket is taken out of rotation and
    none of its tokens is trained, with a client that is not an ``SGLangClient``."""
    run_dir = str(tmp_path / "run")
    q = make_run(run_dir, 0, rows=rows(16), group_size=2, release_batch=4)
    sim = SimConfig(time_scale=0.2, len_median=20, len_sigma=0.5, len_cap=60, cap_prob=0.0)
    with EngineThread(EngineOptions(kind="sim", max_running=64, sim=sim)) as eng:
        cfg = _config(run_dir, eng.url, slots=2,
                      sampling=SamplerParams(max_new_tokens=40, seed=1),
                      engine={"backoff_s": 0.05})

        async def main() -> None:
            async with SGLangClient([eng.url]) as inner:
                p = Producer(cfg, queue=q, client=Delegating(inner))  # type: ignore[arg-type]

                async def body() -> None:
                    await wait_for(lambda: len(ids(q, "ready")) >= 1, 60, "a first group")
                    before = set(ids(q, "ready"))
                    # the engine changes weights with no bracket: its replies are not the run's
                    await inner.update_weight_version(1, abort_all_requests=False)
                    await wait_for(lambda: bool(p.guard.stale), 60, "the engine out of rotation")
                    assert p.stats().stale_replies >= 1
                    assert before <= set(ids(q, "ready"))

                await run_producers([p], body)

        asyncio.run(main())
    assert versions_of(q) == {0}, "a group holds tokens of weights that are not the run's"


# -- the segment deadline (issue 21, finding 6) -------------------------------------------------
@pytest.mark.slow
def test_a_segment_past_its_deadline_is_aborted_and_keeps_every_token() -> None:
    """60 tokens at 10 ms each against a 0.15 s deadline: each cut keeps its tokens and the
    next segment resumes from them, until the response ends exactly as an uncut one."""
    params = SamplerParams(max_new_tokens=200, temperature=1.0, seed=11)
    with EngineThread(EngineOptions(kind="sim", max_running=8, sim=PACED)) as eng:

        async def go() -> tuple[Sample, Sample, int, int]:
            async with SGLangClient([eng.url], config=ClientConfig(max_retries=0)) as c:
                ref = Sample.new("ref", [5, 9, 11], params)
                await step_sample(c, ref)
            cfg = ClientConfig(max_retries=0, generate_timeout_s=0.15)
            async with SGLangClient([eng.url], config=cfg) as c:
                s = Sample.new("cut", [5, 9, 11], params)
                segments = 0
                while not s.is_final:
                    await step_sample(c, s, rid=f"cut.{segments}")
                    segments += 1
                return ref, s, segments, c.deadline_aborts

        ref, cut, segments, aborts = asyncio.run(go())
    assert ref.status is SampleStatus.COMPLETED and ref.response_length == 60
    assert aborts >= 1 and segments == aborts + 1
    assert cut.status is SampleStatus.COMPLETED
    assert cut.response_ids.tolist() == ref.response_ids.tolist()
    assert np.allclose(cut.logprobs, ref.logprobs)


def test_producer_finishes_segments_longer_than_the_deadline(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    q = make_run(run_dir, 0, rows=rows(3), group_size=2)
    with EngineThread(EngineOptions(kind="sim", max_running=16, sim=PACED)) as eng:
        p = Producer(_config(run_dir, eng.url, slots=3,
                             sampling=SamplerParams(max_new_tokens=200, seed=1),
                             engine={"sample_retries": 0,
                                     "client": ClientConfig(generate_timeout_s=0.15,
                                                            max_retries=0)}))

        async def body() -> None:
            await wait_for(lambda: len(ids(q, "ready")) == 3, 90, "every group ready")

        asyncio.run(run_producers([p], body))
    st = p.stats()
    groups = ready_groups(q)
    assert all(list(g.sample_lens) == [60, 60] for g in groups.values())
    assert st.segment_deadlines >= 1 and st.engine_faults == 0
    assert st.tokens_generated == sum(int(sum(g.sample_lens)) for g in groups.values())


# -- the bracket aborts retried requests (finding 7) --------------------------------------------
def test_the_bracket_aborts_a_retried_request_by_its_own_rid(tmp_path: Path) -> None:
    """Every first attempt fails (HTTP 500), so each segment runs as ``<rid>~retry1``: the
    pause must abort that rid, get the tokens back at once, and lose no request."""
    run_dir = str(tmp_path / "run")
    q = make_run(run_dir, 0, rows=rows(1), group_size=2)
    control = Control(q.storage)
    with EngineThread(EngineOptions(kind="sim", max_running=16, sim=ENDLESS)) as eng, \
            FaultyProxy(eng.url, mode="first_try_fails") as proxy:
        p = Producer(_config(run_dir, proxy.url, slots=1,
                             sampling=SamplerParams(max_new_tokens=1000, ignore_eos=True,
                                                    seed=1),
                             engine={"client": ClientConfig(backoff_base_s=0.01,
                                                            backoff_max_s=0.02)},
                             timing={"abort_poll_s": 0.1, "abort_deadline_s": 3.0}))
        seen: set[str] = set()

        async def body() -> None:
            async def watch() -> None:
                while True:
                    seen.update(p.live_rids())
                    await asyncio.sleep(0.005)
            w = asyncio.create_task(watch())
            await wait_for(lambda: proxy.calls["ok"] >= 2 and p.stats().busy_trajectories == 2,
                           60, "both samples generating on their retry")
            await asyncio.sleep(0.3)
            control.pause(1)
            await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
            w.cancel()

        asyncio.run(run_producers([p], body))
    assert any("~retry1" in r for r in seen), seen
    assert p._aborter.lost_requests == 0
    group = saved_partial(q)
    assert all(n > 0 for n in group.sample_lens)
    assert p.stats().tokens_generated == int(sum(group.sample_lens))


# -- a sample's failure aborts its siblings (finding 8) -----------------------------------------
class FailsSampleZero(Delegating):
    """Sample 0's requests fail (engine unreachable) once its siblings are generating."""

    def __init__(self, inner: SGLangClient) -> None:
        super().__init__(inner)
        self.failed = 0

    async def generate(self, input_ids: Any, sampling_params: Any, **kw: Any) -> Any:
        if "/0." in str(kw.get("rid")):
            await asyncio.sleep(0.3)
            self.failed += 1
            raise EngineUnavailable("injected: the engine went away", url="http://injected")
        return await self._inner.generate(input_ids, sampling_params, **kw)


def test_a_failed_sample_aborts_its_siblings_and_keeps_their_tokens(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    q = make_run(run_dir, 0, rows=rows(1), group_size=3)
    with EngineThread(EngineOptions(kind="sim", max_running=16, sim=ENDLESS)) as eng:
        cfg = _config(run_dir, eng.url, slots=1,
                      sampling=SamplerParams(max_new_tokens=1000, ignore_eos=True, seed=1),
                      engine={"sample_retries": 0, "backoff_s": 30.0},
                      timing={"abort_poll_s": 0.1, "abort_deadline_s": 3.0})

        async def main() -> FailsSampleZero:
            async with SGLangClient([eng.url]) as inner:
                client = FailsSampleZero(inner)
                p = Producer(cfg, queue=q, client=client)  # type: ignore[arg-type]

                async def body() -> None:
                    await wait_for(lambda: p.stats().groups_yielded >= 1, 60, "handed back")

                await run_producers([p], body)
                assert p._aborter.lost_requests == 0
                assert p.stats().tokens_generated > 0
                return client

        client = asyncio.run(main())
    assert client.failed == 1
    group = saved_partial(q)
    lens = list(group.sample_lens)
    assert lens[0] == 0 and lens[1] > 0 and lens[2] > 0, lens


# -- EOS ids at start (finding 10) --------------------------------------------------------------
class _Info:
    worker_urls = ["http://e1"]

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info

    async def model_info(self, url: str) -> dict[str, Any]:
        return self.info


class _Tok:
    eos_token_id = 7


def test_eos_ids_come_from_config_engine_tokenizer_or_model_files(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text('{"eos_token_id": [3, 4]}')

    async def go() -> None:
        sglang_like = _Info({"model_path": "/only/on/the/engine/host"})
        assert await resolve_eos_ids(sglang_like, configured=(9,)) == {9}  # type: ignore[arg-type]
        assert await resolve_eos_ids(_Info({"eos_token_id": 2}),  # type: ignore[arg-type]
                                     configured=None) == {2}
        assert await resolve_eos_ids(sglang_like, configured=None,  # type: ignore[arg-type]
                                     tokenizer=_Tok()) == {7}
        assert await resolve_eos_ids(_Info({"model_path": str(model)}),  # type: ignore[arg-type]
                                     configured=None) == {3, 4}
        with pytest.raises(ConfigError, match="cannot find the model's EOS ids") as info:
            await resolve_eos_ids(sglang_like, configured=None)  # type: ignore[arg-type]
        assert "/only/on/the/engine/host" in str(info.value)
        assert "generation.eos_token_ids" in str(info.value)
        assert await resolve_eos_ids(sglang_like, configured=None,  # type: ignore[arg-type]
                                     ignore_eos=True) == frozenset()

    asyncio.run(go())


def test_a_producer_that_cannot_resolve_eos_ids_refuses_to_start(tmp_path: Path) -> None:
    """SGLang 0.5.23's /model_info names no EOS id; with a model path only the engine's host
    can read and no tokenizer, the producer refuses to start, claiming nothing."""
    run_dir = str(tmp_path / "run")
    q = make_run(run_dir, 0, rows=rows(2), group_size=2)
    with EngineThread(EngineOptions(kind="sim", max_running=8, sim=PACED)) as eng:

        class SGLangLike(Delegating):
            async def model_info(self, url: str) -> dict[str, Any]:
                info = dict(await self._inner.model_info(url))
                info.pop("eos_token_id", None)
                info["model_path"] = "/only/on/the/engine/host"
                return info

        def producer(client: Any, **kw: Any) -> Producer:
            return Producer(_config(run_dir, eng.url, slots=1,
                                    sampling=SamplerParams(max_new_tokens=8, **kw)),
                            queue=q, client=client)

        async def main() -> None:
            async with SGLangClient([eng.url]) as inner:
                with pytest.raises(ConfigError, match="EOS ids"):
                    await asyncio.wait_for(producer(SGLangLike(inner)).run(), 30)
                assert len(ids(q, "pending")) == 2 and not names(q, "leased")
                p = producer(SGLangLike(inner), ignore_eos=True)  # nothing to resolve

                async def body() -> None:
                    await wait_for(lambda: len(ids(q, "ready")) == 2, 60, "ready")

                await run_producers([p], body)

        asyncio.run(main())
