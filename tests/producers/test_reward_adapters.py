"""Async rewards, the remote reward model over HTTP, and the slime / verl adapters."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from strawq.errors import ConfigError  # noqa: E402
from strawq.producers.offload import Offload  # noqa: E402
from strawq.producers.plugins import call_reward, check_reward_fn, load_reward  # noqa: E402
from strawq.producers.reward_remote import RemoteReward, RemoteRewardError  # noqa: E402

PLUGINS = "tests.producers.reward_plugins"
TASK = {"id": "i000000000003", "index": 3,
        "row": {"prompt": [{"role": "user", "content": "2+2?"}], "label": "4",
                "metadata": {"rm_type": "math"}}}
META = {"text": "stitched", "status": "completed", "finish_reason": "stop",
        "sample_index": 1, "prompt_ids": [7, 8], "num_segments": 2}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_async_and_plain_rewards_and_decoded_text() -> None:
    fn = load_reward(f"{PLUGINS}.async_text_length")
    threads = Offload(1, "rw")
    assert run(call_reward(fn, threads, TASK, [1, 2], META)) == len("stitched")
    decoded = run(call_reward(fn, threads, TASK, [1, 2], META,
                              decode=lambda ids: "x" * len(ids)))
    assert decoded == 2.0  # the decoded ids, never the stitched segment texts
    assert check_reward_fn(fn, TASK, [1], {"text": "abc"}) == 3.0
    with pytest.raises(ConfigError, match="reward factory"):
        load_reward("strawq.producers.reward_remote.remote_reward", {"url": "ftp://x"})


def test_reward_factory_with_required_keyword_arguments() -> None:
    # the factory is called with reward_args; it is not required to take zero arguments
    fn = load_reward(f"{PLUGINS}.length_at_least", {"threshold": 2})
    threads = Offload(1, "rw")
    assert run(call_reward(fn, threads, TASK, [1, 2], META)) == 1.0
    assert run(call_reward(fn, threads, TASK, [1], META)) == 0.0
    with pytest.raises(ConfigError, match="bad reward_args"):
        load_reward(f"{PLUGINS}.length_at_least", {})


class RewardServer:
    """A reward model stand-in on a real socket: scores, fails, stalls on request."""

    def __init__(self) -> None:
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.fail_first = 0
        self.delay_s = 0.0
        self.bodies: list[dict[str, Any]] = []

    async def score(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls += 1
        self.bodies.append(body)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)
            if self.calls <= self.fail_first:
                return web.Response(status=503, text="overloaded")
            return web.json_response({"reward": float(body["response"] == body["label"])})
        finally:
            self.active -= 1

    async def bad(self, request: web.Request) -> web.Response:
        return web.Response(status=422, text="bad input")

    async def nonsense(self, request: web.Request) -> web.Response:
        return web.json_response({"value": "high"})


async def serve(server: RewardServer) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/score", server.score)
    app.router.add_post("/bad", server.bad)
    app.router.add_post("/nonsense", server.nonsense)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.slow
def test_remote_reward_concurrency_retries_timeout_and_errors() -> None:
    async def body() -> None:
        srv = RewardServer()
        async for url in serve(srv):
            rm = RemoteReward(f"{url}/score", concurrency=3, retries=2, backoff_s=0.01,
                              timeout_s=2.0)
            srv.delay_s = 0.05
            metas = [{**META, "text": "4" if i % 2 else "5", "sample_index": i}
                     for i in range(12)]
            got = await asyncio.gather(*(rm(TASK, [1], m) for m in metas))
            assert got == [float(i % 2) for i in range(12)]
            assert srv.max_active == 3 and rm.max_in_flight == 3
            assert srv.bodies[0]["label"] == "4" and srv.bodies[0]["prompt"] == TASK["row"][
                "prompt"] and srv.bodies[0]["response_ids"] == [1]
            # 5xx is retried
            srv.calls, srv.fail_first, srv.delay_s = 0, 2, 0.0
            assert await rm(TASK, [1], {**META, "text": "4"}) == 1.0 and srv.calls == 3
            srv.calls, srv.fail_first = 0, 5
            with pytest.raises(RemoteRewardError, match="failed after 3 tries.*503"):
                await rm(TASK, [1], META)
            # a timeout is retried, then fails
            srv.calls, srv.fail_first, srv.delay_s = 0, 0, 1.0
            slow = RemoteReward(f"{url}/score", timeout_s=0.2, retries=1, backoff_s=0.0)
            t0 = time.monotonic()
            with pytest.raises(RemoteRewardError, match="TimeoutError"):
                await slow(TASK, [1], META)
            assert srv.calls == 2 and time.monotonic() - t0 < 1.5
            srv.delay_s = 0.0
            # a refusal is not retried; an unusable reply is an error
            with pytest.raises(RemoteRewardError, match="422"):
                await RemoteReward(f"{url}/bad", retries=3)(TASK, [1], META)
            with pytest.raises(RemoteRewardError, match="none of"):
                await RemoteReward(f"{url}/nonsense")(TASK, [1], META)
            await rm.aclose()
        # nobody listening: connection errors are retried, then recorded as the error
        dead = RemoteReward(url + "/score", retries=1, backoff_s=0.0, timeout_s=1.0)
        with pytest.raises(RemoteRewardError, match="failed after 2 tries"):
            await dead(TASK, [1], META)
    run(body())


def test_remote_reward_through_the_factory_path() -> None:
    fn = load_reward("strawq.producers.reward_remote.remote_reward",
                     {"url": "http://127.0.0.1:9/score", "concurrency": 2})
    assert isinstance(fn, RemoteReward) and fn.concurrency == 2


def test_slime_custom_rm_path_unchanged() -> None:
    pytest.importorskip("slime.utils.types")
    fn = load_reward("strawq.producers.reward_slime.slime_rm",
                     {"path": f"{PLUGINS}.slime_custom_rm", "args": {"scale": 2.0},
                      "reward_key": "acc"})
    threads = Offload(1, "rw")
    assert run(call_reward(fn, threads, TASK, [5, 6, 7], {**META, "text": "it is 4"})) == 2.0
    assert run(call_reward(fn, threads, TASK, [5], {**META, "text": "it is 5"})) == 0.0
    plain = load_reward("strawq.producers.reward_slime.slime_rm",
                        {"path": f"{PLUGINS}.slime_sync_rm"})
    assert run(call_reward(plain, threads, TASK, [5, 6, 7], META)) == 5.0  # 2 prompt + 3
    nokey = load_reward("strawq.producers.reward_slime.slime_rm",
                        {"path": f"{PLUGINS}.slime_custom_rm", "args": {"scale": 1.0}})
    with pytest.raises(ValueError, match="reward_key"):
        run(call_reward(nokey, threads, TASK, [1], META))


def test_slime_rm_hub_rule_based_reward() -> None:
    pytest.importorskip("slime.utils.types")
    pytest.importorskip("pylatexenc")  # slime's math grader needs it
    fn = load_reward("strawq.producers.reward_slime.slime_rm", {"args": {"rm_type": "math"}})
    threads = Offload(1, "rw")
    assert run(call_reward(fn, threads, TASK, [1], {**META, "text": "so \\boxed{4}"})) == 1.0
    assert run(call_reward(fn, threads, TASK, [1], {**META, "text": "so \\boxed{5}"})) == 0.0


def test_verl_compute_score_unchanged() -> None:
    task = {"id": "i0", "index": 0,
            "row": {"prompt": "q", "data_source": "openai/gsm8k",
                    "reward_model": {"style": "rule", "ground_truth": "72"},
                    "extra_info": {"bonus": 0.25}}}
    threads = Offload(1, "rw")
    fn = load_reward("strawq.producers.reward_verl.verl_score",
                     {"path": f"{PLUGINS}.verl_compute_score"})
    assert run(call_reward(fn, threads, task, [1], {"text": "so #### 72"})) == 1.25
    assert run(call_reward(fn, threads, task, [1], {"text": "#### 71"})) == 0.25
    old = load_reward("strawq.producers.reward_verl.verl_score",
                      {"path": f"{PLUGINS}.verl_old_style"})
    flat = {"id": "i1", "row": {"data_source": "x", "ground_truth": "42"}}
    assert run(call_reward(old, threads, flat, [1], {"text": "42!"})) == 1.0
    aio = load_reward("strawq.producers.reward_verl.verl_score",
                      {"path": f"{PLUGINS}.verl_async_score"})
    assert run(call_reward(aio, threads, task, [1], {"text": ""})) == 0.5
    other = {"id": "i2", "row": {**task["row"], "data_source": "unknown"}}
    with pytest.raises(NotImplementedError):
        run(call_reward(fn, threads, other, [1], {"text": "x"}))


def test_reward_threads_do_not_block_async_rewards() -> None:
    """An async reward runs on the loop: a full reward pool does not hold it up."""
    gate = threading.Event()
    threads = Offload(1, "rw")
    threads.start()

    def blocking(task: Any, ids: Any, meta: Any) -> float:
        gate.wait(5)
        return 1.0

    async def quick(task: Any, ids: Any, meta: Any) -> float:
        return 2.0

    async def body() -> None:
        slow = asyncio.create_task(call_reward(blocking, threads, TASK, [1], META))
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(call_reward(quick, threads, TASK, [1], META), 1) == 2.0
        gate.set()
        assert await slow == 1.0
    run(body())
    threads.shutdown()


# -- through the producer: chat prompts tokenized, rewards on decoded ids -----------------------
def test_producer_tokenizes_chat_and_rewards_see_decoded_ids(tmp_path: Any,
                                                              sim_engine: Any) -> None:
    pytest.importorskip("transformers")
    from strawq.data.tokenize import HFTokenizer
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import (
        BudgetConfig,
        EngineConfig,
        PluginsConfig,
        ProducerConfig,
        SamplerParams,
        TimingConfig,
    )
    from tests.producers.helpers import ids, make_run, ready_groups, run_producers, wait_for
    from tests.tokenizer_fixtures import train_chat_tokenizer

    tok_dir = train_chat_tokenizer(tmp_path / "tok")
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus two?"}],
             "chat_template_kwargs": {"enable_thinking": bool(i % 2)}} for i in range(3)]
    q = make_run(str(tmp_path / "run"), 0, rows=rows)
    p = Producer(ProducerConfig(
        run_dir=str(tmp_path / "run"),
        engine=EngineConfig(workers=(sim_engine.url,)),
        plugins=PluginsConfig(reward=f"{PLUGINS}.async_text_length", tokenizer=f"hf:{tok_dir}",
                              tokenizer_args={"local_files_only": True}),
        sampling=SamplerParams(max_new_tokens=32, seed=3),
        budget=BudgetConfig(slots=2),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))
    asyncio.run(run_producers([p], lambda: wait_for(lambda: len(ids(q, "ready")) == 3, 60,
                                                    "ready")))
    tok = HFTokenizer(tok_dir, local_files_only=True)
    for task_id, g in ready_groups(q).items():
        row = rows[int(task_id[1:])]
        assert g.prompt_ids.tolist() == tok.encode_prompt(row["prompt"], row)
        for j in range(g.num_samples):
            response = g.sample(j)["tokens"].tolist()
            assert g.rewards[j] == float(len(tok.decode(response)))


def test_a_failed_remote_reward_is_never_trained(tmp_path: Any, sim_engine: Any) -> None:
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import (
        BudgetConfig,
        EngineConfig,
        PluginsConfig,
        ProducerConfig,
        SamplerParams,
        TimingConfig,
    )
    from tests.producers.helpers import make_run, names, run_producers, wait_for

    q = make_run(str(tmp_path / "run"), 2)
    p = Producer(ProducerConfig(
        run_dir=str(tmp_path / "run"),
        engine=EngineConfig(workers=(sim_engine.url,)),
        plugins=PluginsConfig(reward="strawq.producers.reward_remote.remote_reward",
                              reward_args={"url": "http://127.0.0.1:9/score", "retries": 1,
                                           "backoff_s": 0.0, "timeout_s": 1.0}),
        sampling=SamplerParams(max_new_tokens=16),
        budget=BudgetConfig(slots=2),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))
    asyncio.run(run_producers([p], lambda: wait_for(lambda: len(names(q, "dropped")) == 2, 60,
                                                    "dropped")))
    assert {t.producer for t in names(q, "dropped")} == {"reward_error"}
    assert not names(q, "ready") and p.stats().reward_errors == 8
