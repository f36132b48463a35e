"""A producer killed for real (``kill -9``) with the in-flight journal on: the next holder
resumes every group from the journal prefix, and nothing is lost or trained twice."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.producers.producer import Producer
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.journal import load_chain, record_keys, writers
from tests.producers.helpers import ids, make_run, names, ready_groups
from tests.producers.test_faults import cfg, check_exactly_once

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.process]

PLUGINS = "tests.producers.plugins_for_tests"
REPO = Path(__file__).resolve().parents[2]


def _journaled(q: Any) -> dict[str, list[np.ndarray]]:
    """Per held task whose samples are all final in its holder's journal prefix, their
    tokens."""
    out: dict[str, list[np.ndarray]] = {}
    for w in writers(q.storage):
        for x in names(q, "leased"):
            chain = load_chain(q.storage, w, x.id, x.gen)
            if chain is None:
                continue
            toks: dict[int, np.ndarray] = {}
            final: dict[int, bool] = {}
            for e in chain:
                for p in e["samples"]:
                    i = int(p["i"])
                    new = np.frombuffer(p["tokens"], np.int32)
                    toks[i] = new if p["start"] == 0 else np.concatenate([toks[i], new])
                    final[i] = p["status"] in ("completed", "truncated")
            if len(final) == 4 and all(final.values()):
                out[x.id] = [toks[i] for i in range(4)]
    return out


def test_a_producer_killed_mid_group_resumes_from_its_journal(tmp_path: Path,
                                                              sim_engine: Any) -> None:
    n = 3
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=1.0, heartbeat_interval_s=0.1)
    code = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(run), "--engine", sim_engine.url,
         "--reward", f"{PLUGINS}.stuck_reward", "--slots", "3",
         "--set", "sampling.max_new_tokens=64", "--set", "timing.idle_poll_s=0.02",
         "--set", "timing.journal_every_tokens=1", "--set", "timing.journal_every_s=0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while True:  # every group's samples final (their verifier stuck) and journaled
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the journal never held every sample"
            got = _journaled(q)
            if len(got) == n:
                break
            time.sleep(0.05)
    finally:
        proc.kill()  # kill -9: no park, no hand-back
        proc.wait()
    assert sorted(ids(q, "leased")) == sorted(got)
    assert any(record_keys(q.storage, w) for w in writers(q.storage))

    healthy = Producer(cfg(run, [sim_engine.url], budget={"slots": 3}))
    monitor = LeaseMonitor(q)

    async def body() -> None:
        task = asyncio.create_task(healthy.run())
        deadline = asyncio.get_running_loop().time() + 60
        try:
            while len(ids(q, "ready")) < n:
                assert asyncio.get_running_loop().time() < deadline, "work not finished"
                monitor.scan()
                await asyncio.sleep(0.05)
        finally:
            healthy.request_stop()
            await task

    asyncio.run(body())
    check_exactly_once(q, n)
    assert healthy.stats().journal_resumes == n
    for tid, group in ready_groups(q).items():  # not one token generated again
        for i, toks in enumerate(got[tid]):
            np.testing.assert_array_equal(group.sample(i)["tokens"], toks)


def test_a_weight_update_parks_every_group_into_one_journal_record(tmp_path: Path,
                                                                 sim_engine: Any) -> None:
    """A pause parks the held groups with the journal on: no ``.partial`` is written, each
    queued name names the producer's journal, and after the update every group resumes from
    it and is ready once."""
    from strawq.weights.control import Control
    from tests.producers.helpers import run_producers, wait_for

    n = 6
    run = tmp_path / "run"
    q = make_run(str(run), n, lease_timeout_s=5.0, heartbeat_interval_s=0.1)
    control = Control(q.storage)
    p = Producer(cfg(run, [sim_engine.url], budget={"slots": 3},
                     sampling={"max_new_tokens": 3000, "ignore_eos": True, "seed": 3},
                     timing={"control_poll_s": 0.02, "idle_poll_s": 0.02,
                             "abort_deadline_s": 2.0, "journal_every_tokens": 0,
                             "journal_every_s": 60.0,  # no window before the park
                             "hold_through_pause": False}))  # a park, not the default hold
    seen: dict[str, Any] = {}

    async def body() -> None:
        await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "generating")
        before = p.stats().journal_records
        control.pause(1)
        await wait_for(lambda: p.producer_id in control.state().acks, 30, "ack")
        parked = [t for t in names(q, "pending") if t.resume >= 0]
        seen["parked"] = parked
        seen["records"] = p.stats().journal_records - before
        seen["partials"] = [k for k in q.storage.list("data") if k.endswith(".partial")]
        control.resume(1)  # the same weights: the park is the point here
        await wait_for(lambda: len(ids(q, "ready")) == n, 60, "all ready")

    asyncio.run(run_producers([p], body))
    assert seen["parked"], "the pause found no group in flight"
    assert all(t.producer == p.producer_id for t in seen["parked"])
    assert seen["partials"] == [] and seen["records"] == 1
    st = p.stats()
    assert st.groups_yielded_journal == len(seen["parked"])
    assert st.journal_resumes >= len(seen["parked"])
    check_exactly_once(q, n)
