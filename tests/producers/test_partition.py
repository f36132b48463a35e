"""A network partition between a producer and its engine: real processes, a real link cut.

The engine (the sim engine, a subprocess) runs in its own network namespace, joined to
this one by a veth pair; the partition takes the engine's end of the link down, so the
producer's packets vanish without an answer (no reset, no refusal), as in a real
partition. The filesystem stays shared, so the producer keeps heartbeating throughout:
its leases must not sit on requests that can never return, it must not claim what it
cannot run, and nothing may be lost or trained twice once the link heals.

Needs root and ``ip netns`` (iproute2); skipped, saying why, without them. The router test
also needs sglang-router (required in CI, ``STRAWQ_REQUIRE_SGLANG=1``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from strawq.producers.engines.testing import start_engine_subprocess
from strawq.producers.producer import Producer
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from tests.producers.helpers import (
    config_with,
    ids,
    make_run,
    ready_groups,
    run_producers,
    wait_for,
)
from tests.sglang_fixtures import start_router

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

PLUGINS = "tests.producers.plugins_for_tests"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _netns_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed (apt-get install -y iproute2)")
    probe = f"sqprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"`ip netns add` does not work here: {getattr(exc, 'stderr', exc)}")
    _ip("netns", "del", probe)


@dataclass
class Link:
    ns: str
    host_dev: str
    ns_dev: str
    engine_ip: str

    def cut(self) -> None:
        """The engine's end goes down: the producer's packets are dropped unanswered."""
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_dev, "down")

    def heal(self) -> None:
        _ip("netns", "exec", self.ns, "ip", "link", "set", self.ns_dev, "up")


@contextmanager
def engine_namespace(tag: str) -> Iterator[Link]:
    """A network namespace joined to this one by a veth pair (/30, names unique per pid)."""
    _netns_or_skip()
    pid = os.getpid()
    ns, host_dev, ns_dev = f"sq{tag}{pid}", f"sq{tag}{pid}h"[:15], f"sq{tag}{pid}n"[:15]
    # a /30 in 198.18.0.0/15, the range set aside for network tests (RFC 2544)
    net, base = f"198.{18 + pid % 2}.{(pid // 2) % 256}", 4 * ((pid // 512) % 64)
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev, "netns", ns)
        _ip("addr", "add", f"{net}.{base + 1}/30", "dev", host_dev)
        _ip("link", "set", host_dev, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{net}.{base + 2}/30", "dev", ns_dev)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_dev, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield Link(ns, host_dev, ns_dev, f"{net}.{base + 2}")
    finally:
        subprocess.run(["ip", "link", "del", host_dev], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


async def _cut_then_heal(p: Producer, q: RunQueue, link: Link, held: Callable[[], int],
                         n: int, handed_back: str, probed: str) -> None:
    """Requests in flight, then the link cut: the groups in flight come back as partials
    (bounded: none held on); partitioned, the producer probes at the back-off's pace and
    claims nothing; healed, every task ends ready."""
    await wait_for(lambda: p.pool.busy > 0 and held() > 0, 30, "requests in flight")
    link.cut()
    await wait_for(lambda: held() == 0 and not p.runner.groups, 40, handed_back)
    claimed = p.stats().groups_claimed
    await wait_for(lambda: p.stats().engine_probes_failed >= 2, 40, probed)
    assert p.stats().groups_claimed == claimed
    assert held() == 0
    link.heal()
    await wait_for(lambda: held() + len(ids(q, "ready")) == n and held() == 0, 60,
                   "every task ready after the link healed")


def test_a_producer_cut_off_from_its_engine_hands_back_claims_nothing_and_loses_nothing(
        tmp_path: Path) -> None:
    """Cut mid-generation: the requests in flight end after about ``control_timeout_s``
    (TCP keep-alive), not after ``generate_timeout_s`` (an hour); the groups go back as
    partials (no attempt spent); while cut off the producer only probes, claiming nothing;
    healed, it finishes every task, each exactly once, and no lease ever expired."""
    n = 4
    q = make_run(str(tmp_path / "run"), n, lease_timeout_s=5.0, heartbeat_interval_s=0.2)
    monitor = LeaseMonitor(q)
    expired: list[str] = []
    with engine_namespace("p") as link:
        # ~40 tokens at ~30 ms a step: each sample takes about a second, so a cut finds
        # requests in flight
        eng = start_engine_subprocess(
            "sim", 0, wrap=["ip", "netns", "exec", link.ns], host=link.engine_ip,
            time_scale=3.0, len_median=40, len_sigma=0.3, len_cap=60, cap_prob=0.0)
        try:
            cfg = config_with({"run_dir": str(tmp_path / "run")}, {
                "engine": {"workers": (eng.url,), "sample_retries": 0, "backoff_s": 0.1,
                           "client": {"connect_timeout_s": 0.5, "control_timeout_s": 1.0,
                                      "max_retries": 1, "backoff_base_s": 0.05,
                                      "backoff_max_s": 0.1}},
                "plugins": {"reward": f"{PLUGINS}.length_reward"},
                "budget": {"slots": 2}, "sampling": {"max_new_tokens": 64, "seed": 1},
                "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}})
            p = Producer(cfg)

            def scan() -> None:
                expired.extend(monitor.scan().expired)

            def held() -> int:
                scan()
                return len(ids(q, "leased"))

            asyncio.run(run_producers([p], lambda: _cut_then_heal(
                p, q, link, held, n, "the cut-off producer to hand back its leases",
                "the producer to probe the unreachable engine")))
        finally:
            eng.stop()
    st = p.stats()
    ready = ids(q, "ready")
    assert ready == sorted(set(ready)) and len(ready) == n  # each task exactly once
    assert ids(q, "dropped") == [] and ids(q, "pending") == [] and ids(q, "leased") == []
    assert expired == []  # handed back by the producer itself, never expired
    assert st.groups_yielded >= 1 and st.groups_failed == 0
    for grp in ready_groups(q).values():
        assert grp.num_samples == 4


def test_an_engine_cut_off_from_the_router_stops_the_producers_claims_until_it_heals(
        tmp_path: Path, sglang_router_cmd: list[str]) -> None:
    """The router (here, as the producer) loses its only engine mid-generation: the
    requests in flight end at the router's ``--request-timeout-secs`` and go back as
    partials; the router lists the worker unhealthy and answers 503, and the producer,
    probing the router's worker list, claims nothing until the router finds the worker
    healthy again; then every task is ready exactly once."""
    n = 4
    q = make_run(str(tmp_path / "run"), n, lease_timeout_s=5.0, heartbeat_interval_s=0.2)
    monitor = LeaseMonitor(q)
    expired: list[str] = []
    with engine_namespace("r") as link:
        eng = start_engine_subprocess(
            "sim", 0, wrap=["ip", "netns", "exec", link.ns], host=link.engine_ip,
            time_scale=3.0, len_median=40, len_sigma=0.3, len_cap=60, cap_prob=0.0)
        router = None
        try:
            router = start_router(sglang_router_cmd, [eng.url], log=tmp_path / "router.log",
                                  extra_args=("--request-timeout-secs", "3",
                                              "--health-check-interval-secs", "1",
                                              "--health-check-timeout-secs", "1",
                                              "--health-failure-threshold", "2",
                                              "--retry-max-retries", "1"))
            cfg = config_with({"run_dir": str(tmp_path / "run")}, {
                "engine": {"router_url": router.url, "sample_retries": 0, "backoff_s": 0.1,
                           "client": {"connect_timeout_s": 0.5, "control_timeout_s": 1.0,
                                      "max_retries": 1, "backoff_base_s": 0.05,
                                      "backoff_max_s": 0.1}},
                "plugins": {"reward": f"{PLUGINS}.length_reward"},
                "budget": {"slots": 2}, "sampling": {"max_new_tokens": 64, "seed": 1},
                "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}})
            p = Producer(cfg)

            def held() -> int:
                expired.extend(monitor.scan().expired)
                return len(ids(q, "leased"))

            asyncio.run(run_producers([p], lambda: _cut_then_heal(
                p, q, link, held, n, "the producer to hand back the groups the router lost",
                "the producer to find no healthy worker behind the router")))
        finally:
            if router is not None:
                router.stop()
            eng.stop()
    ready = ids(q, "ready")
    assert ready == sorted(set(ready)) and len(ready) == n
    assert ids(q, "dropped") == [] and ids(q, "pending") == [] and ids(q, "leased") == []
    assert expired == []
    assert p.stats().groups_yielded >= 1 and p.stats().groups_failed == 0
