"""kill -9 of a producer process mid-trajectory, with turn checkpoints: the next holder
resumes from the last saved turn — no saved model turn generated again, no saved tool call
executed again, every tool effect applied once, every environment restored (the toy
key-value agent checks its store against its recorded calls)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from strawq.demo.agentic_kv import counts
from strawq.ondisk import records
from strawq.ondisk.groups import GroupData
from strawq.ondisk.records import Kind
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.trajectory import Trajectory
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.turns import TURNS_DIR
from strawq.testing.waiting import wait_until
from tests.producers.conftest import FAST_SIM
from tests.producers.helpers import ids, make_run, names, ready_groups

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
KV = "strawq.demo.agentic_kv.kv_agent"


def producer_process(run: Path, url: str, ledger: Path, *extra: str) -> subprocess.Popen[str]:
    code = ("import sys; sys.modules['ray'] = None; from strawq.app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = {"ledger": str(ledger), "turns": 8, "tool_s": 0.15}
    return subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(run), "--engine", url, "--reward",
         "strawq.producers.rewards.count_task", "--slots", "4",
         "--set", "sampling.max_new_tokens=240", "--set", "sampling.seed=7",
         "--set", f"plugins.generate={KV}", "--set", f"plugins.generate_args={json.dumps(args)}",
         "--set", "timing.idle_poll_s=0.02", "--set", "timing.control_poll_s=0.02", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})


def saved_checkpoints(storage: Any) -> list[GroupData]:
    """Every turn checkpoint record on the store (fences left out)."""
    out = []
    for task in storage.list(TURNS_DIR):
        for n in storage.list(f"{TURNS_DIR}/{task}"):
            try:
                rec = records.decode(storage.read(f"{TURNS_DIR}/{task}/{n}"))
            except Exception:  # noqa: BLE001 - deleted under us
                continue
            if rec.kind is Kind.PARTIAL:
                out.append(GroupData.from_record(rec))
    return out


def saved_work(groups: list[GroupData]) -> tuple[set[str], set[str]]:
    """(``<uid>.<start>`` of every completed turn, key of every tool call) saved."""
    turns, tools = set(), set()
    for grp in groups:
        for i, tr in enumerate(grp.meta.get("trajectories") or []):
            t = Trajectory.from_dict(tr)
            turns |= {f"{grp.task_id}.{i}.{e['start']}" for e in t.events
                      if e["op"] == "gen" and e["end"] is not None}
            tools |= {e["key"] for e in t.tool_calls()}
    return turns, tools


@pytest.mark.slow
def test_kill_9_resumes_from_the_last_saved_turn(tmp_path: Path) -> None:
    with EngineThread(EngineOptions(kind="sim", max_running=256, sim=FAST_SIM)) as eng:
        n, g = 6, 2
        run = tmp_path / "run"
        q = make_run(str(run), n, group_size=g, lease_timeout_s=3.0, heartbeat_interval_s=0.2)
        ledger = tmp_path / "ledger"
        monitor = LeaseMonitor(q)
        a = producer_process(run, eng.url, ledger)
        b: subprocess.Popen[str] | None = None

        def deep_checkpoint() -> bool:
            if a.poll() is not None:
                raise AssertionError(a.stderr.read() if a.stderr else "producer exited")
            turns, tools = saved_work(saved_checkpoints(q.storage))
            return len(turns) >= 8 and len(tools) >= 3 and bool(names(q, "leased"))

        try:
            wait_until(deep_checkpoint, 90, what="turn checkpoints", poll_s=0.05)
            os.kill(a.pid, signal.SIGKILL)  # mid-trajectory: turns saved, tools running
            a.wait(timeout=30)
            turns, tools = saved_work(saved_checkpoints(q.storage))
            b = producer_process(run, eng.url, ledger)
            # every group ready, and no turn checkpoint left behind once handed back
            wait_until(lambda: len(ids(q, "ready")) == n and not any(
                q.storage.list(f"{TURNS_DIR}/{t}") for t in q.storage.list(TURNS_DIR)), 180,
                what="every group ready, its checkpoints removed", poll_s=0.05,
                on_poll=monitor.scan)
        finally:
            for proc in (a, b):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    assert turns and tools
    gens = counts(str(ledger), "gen")
    regenerated = {k: gens[k] for k in turns if gens[k] != 1}
    assert not regenerated, f"saved model turns generated again: {regenerated}"
    execs, effects = counts(str(ledger), "exec"), counts(str(ledger), "effect")
    rerun = {k: execs[k] for k in tools if execs[k] != 1}
    assert not rerun, f"saved tool calls executed again: {rerun}"
    trained = [e["key"] for grp in ready_groups(q).values()
               for tr in grp.meta["trajectories"] for e in Trajectory.from_dict(tr).tool_calls()]
    assert trained and all(effects[k] == 1 for k in trained), "a tool effect applied twice"
    assert not counts(str(ledger), "mismatch"), "an environment did not come back"
    assert sum(counts(str(ledger), "restored").values()) > 0
    for grp in ready_groups(q).values():
        assert not grp.meta.get("failures"), grp.meta["failures"]
