"""``ClientConfig.routing_policy``: ``cache_aware`` keeps every request of a task on one
engine (the one that holds its prefix), round-robin spreads them; a retry goes to the
task's next engine; a worker leaving moves only its own tasks."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.producers.conftest import FAST_SIM
from tests.producers.engine_helpers import run
from tests.conftest import BENCH_QUICK_TIMEOUT_S
from tests.sglang_fixtures import RealServer

from strawq.producers.engine_transport import ClientConfig
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.sglang_client import SGLangClient, affinity_key, rendezvous

TASKS = [f"i{i:012d}" for i in range(12)]
G = 4


@pytest.fixture(scope="module")
def three_engines() -> Iterator[list[str]]:
    engines = [EngineThread(EngineOptions(kind="sim", max_running=64, sim=FAST_SIM))
               for _ in range(3)]
    for e in engines:
        e.__enter__()
    try:
        yield [e.url for e in engines]
    finally:
        for e in engines:
            e.__exit__(None, None, None)


def _where(urls: list[str], policy: str) -> dict[str, set[str]]:
    """Each task's G samples and one resume each: the engines they went to."""
    async def go() -> dict[str, set[str]]:
        client = SGLangClient(urls, config=ClientConfig(routing_policy=policy))
        await client.start()
        seen: dict[str, set[str]] = defaultdict(set)
        try:
            for tid in TASKS:
                for i in range(G):
                    for n in (1, 2):  # the first segment, then its resume
                        res = await client.generate(
                            [5, 6, 7, 8], {"max_new_tokens": 4, "sampling_seed": i},
                            rid=f"p0/{tid}.g0/{i}.{n}")
                        seen[tid].add(res.url)
        finally:
            await client.close()
        return seen
    return run(go())


@pytest.mark.slow
def test_cache_aware_sends_every_request_of_a_task_to_one_engine(
        three_engines: list[str]) -> None:
    seen = _where(three_engines, "cache_aware")
    assert all(len(where) == 1 for where in seen.values()), seen
    assert {rendezvous(t, three_engines)[0] for t in TASKS} == \
        {next(iter(seen[t])) for t in TASKS}
    assert len({next(iter(w)) for w in seen.values()}) >= 2, "every task on one engine"
    # the anchor: round-robin scatters a group's siblings over the engines
    spread = _where(three_engines, "round_robin")
    assert all(len(where) == 3 for where in spread.values()), spread


def test_a_retry_goes_to_the_tasks_next_engine(three_engines: list[str]) -> None:
    dead = "http://127.0.0.1:9"  # discard port: refused
    tid = next(t for t in TASKS if rendezvous(t, [dead, *three_engines])[0] == dead)
    second = rendezvous(tid, [dead, *three_engines])[1]

    async def go() -> str:
        client = SGLangClient([dead, *three_engines], config=ClientConfig(
            routing_policy="cache_aware", backoff_base_s=0.0, backoff_max_s=0.0))
        await client.start()
        try:
            res = await client.generate([5, 6, 7], {"max_new_tokens": 2},
                                        rid=f"p0/{tid}.g3/0.1")
            return res.url
        finally:
            await client.close()
    assert run(go()) == second


def test_rendezvous_moves_only_the_leaving_workers_tasks() -> None:
    urls = [f"http://10.0.0.{i}:30000" for i in range(8)]
    keys = [f"i{i:012d}" for i in range(2000)]
    before = {k: rendezvous(k, urls)[0] for k in keys}
    after = {k: rendezvous(k, urls[1:])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == urls[0] for k in moved)
    share = sum(1 for k in keys if before[k] == urls[0]) / len(keys)
    assert 0.08 < share < 0.18  # about 1/8 of the tasks per worker


def test_the_affinity_key_is_the_task_of_a_producers_rid() -> None:
    assert affinity_key("p0.r2/i000000000007.g3/1.4") == "i000000000007"
    assert affinity_key("host-a/task.with.dots.g12/0.1") == "task.with.dots"
    assert affinity_key("p0/i000000000007.g3/1.4~retry1") == "i000000000007"
    for rid in ("i000000000007.0.teacher", "p0/i7/0.1", "/x.g1/0", "p0/x.gz/0.1"):
        assert affinity_key(rid) is None, rid


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing_policy must be one of"):
        ClientConfig(routing_policy="cache-aware")


@pytest.mark.sglang_real
@pytest.mark.slow
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_the_routing_benchmarks_quick_form_on_the_real_server(
        sglang_real_session: RealServer,
        bench_quick: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """``bench/routing.py --quick`` (tests/bench/test_quick.py's rule, run here: it needs the
    real server) measures ``cached_tokens`` per policy and ends on its summary line."""
    srv = sglang_real_session
    proc = bench_quick("routing", {"STRAWQ_SGLANG_URL": srv.url,
                                   "STRAWQ_SGLANG_API_KEY": srv.api_key or "",
                                   "STRAWQ_SGLANG_ADMIN_KEY": srv.admin_api_key or ""})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"routing: prefix-cache hit rate on resumes and group siblings = "
                     r"(\d\.\d{3}) \(warm_prefix; without it \d\.\d{3}, round_robin "
                     r"\d\.\d{3}\)", last)
    assert m is not None, last
    # the warm-up reaches the real server as a request of max_new_tokens 0 and caches the
    # prompt: the G siblings sent after it find it (less the partial last page at most)
    warm = re.search(r"^cache_aware warm +siblings (\d\.\d{3})", proc.stdout, re.M)
    assert warm is not None and float(warm.group(1)) > 0.9, proc.stdout[-2000:]
    # one server under two names, one cache: a resume (prompt + its first segment, sent
    # after that segment came back) finds its prefix whatever the policy
    for policy in ("round_robin", "cache_aware"):
        row = re.search(rf"^{policy} +siblings \d\.\d{{3}}  resumes (\d\.\d{{3}})", proc.stdout,
                        re.M)
        assert row is not None and float(row.group(1)) > 0.9, proc.stdout[-2000:]


def test_warm_prefix_prefills_each_fresh_groups_prompt_once_before_its_samples(
        tmp_path: Path, sim_engine: Any) -> None:
    """``GenerationConfig.warm_prefix``: a fresh group's prompt goes to the engine once with
    ``max_new_tokens`` 0, under the group's rid prefix (so ``cache_aware`` keeps it with
    the samples), and it comes back before any of the group's samples is sent."""
    from strawq.producers.producer import Producer
    from tests.producers.helpers import config_with, ids, make_run, run_producers, wait_for

    sent: list[tuple[str, int]] = []

    class Recording(SGLangClient):
        async def generate(self, input_ids: Any, sampling_params: Any, **kw: Any) -> Any:
            sent.append((str(kw.get("rid")), int(dict(sampling_params)["max_new_tokens"])))
            return await super().generate(input_ids, sampling_params, **kw)

    n = 6
    q = make_run(str(tmp_path / "run"), n)
    cfg = config_with({"run_dir": str(tmp_path / "run"), "engine": {"workers": (sim_engine.url,)},
                       "plugins": {"reward": "tests.producers.plugins_for_tests.length_reward"},
                       "budget": {"slots": 2}, "sampling": {"max_new_tokens": 16, "seed": 7},
                       "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}},
                      {"engine": {"generation": {"warm_prefix": True},
                                  "client": {"routing_policy": "cache_aware"}}})
    p = Producer(cfg, client=Recording([sim_engine.url], config=cfg.engine.client))

    async def body() -> None:
        await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all groups ready")

    asyncio.run(run_producers([p], body))
    assert p.stats().prefix_warmups == n
    for tid in ids(q, "ready"):
        mine = [(rid, m) for rid, m in sent if f"/{tid}.g" in rid]
        assert mine[0][0].endswith("/warm.0") and mine[0][1] == 0, mine[:3]
        assert all(m > 0 for _, m in mine[1:]) and len(mine) >= 1 + 4
        assert affinity_key(mine[0][0]) == tid
