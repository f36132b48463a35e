"""Agentic rollouts: tool calls re-executed after faults, and the three schedules on a
multi-turn case.

1. **Faults.** A sim engine, two producer *processes* running the simulated agent
   (``strawq.demo.agentic_sim``: turns and tool latency long-tailed; each tool execution
   leaves a ledger file named by its idempotency key). Each round: a weight update (every
   producer parks its groups as partials; the tool calls in those records are *persisted*),
   then a producer is killed with SIGKILL mid-trajectory and a new one started. At the end
   every group must be ready; N = persisted tool calls executed more than once (must be 0).
   Calls in flight at a kill run again with the same key; they are counted separately.
2. **Schedules.** ``strawq lab`` on a multi-turn case (``agent_turns_p`` > 0), modes sync,
   partial and async: the lab's table and async/sync trained-token throughput.

    python bench/agentic.py [--quick] [--rounds R] [--groups N] [--steps S] [--skip-lab]

``--quick`` (the CI size): 2 fault rounds over 12 groups, and a lab of 2 one-second steps
with 0.2 s tool calls: it checks the path; its ratio is not the measurement.

Prints ``agentic: tool calls re-executed after faults = N, async/sync = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from strawq.config import QueueConfig  # noqa: E402
from strawq.control import Control  # noqa: E402
from strawq.dataset import Dataset  # noqa: E402
from strawq.demo.agentic_sim import ledger_counts  # noqa: E402
from strawq.feeder import Feeder  # noqa: E402
from strawq.grantor import LeaseMonitor  # noqa: E402
from strawq.groups import GroupData  # noqa: E402
from strawq.names import TaskName, data_key  # noqa: E402
from strawq.producers.engines.testing import start_engine_subprocess  # noqa: E402
from strawq.producers.sglang_client import SGLangClient  # noqa: E402
from strawq.producers.trajectory import Trajectory  # noqa: E402
from strawq.queue import RunQueue  # noqa: E402
from strawq.records import Kind  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402


def _names(q: RunQueue, state: str) -> list[TaskName]:
    keys = q.list_pending() if state == "pending" else q.storage.list(state)
    out = [TaskName.try_parse(k.rsplit("/", 1)[-1]) for k in keys]
    return [t for t in out if t is not None]


def _producer(run: str, url: str, ledger: str, pid: str) -> subprocess.Popen[bytes]:
    code = ("import sys; sys.modules['ray'] = None; from strawq.app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = {"turns_p": 0.6, "max_turns": 5, "tool_median_s": 0.05, "tool_sigma": 1.0,
            "tool_cap_s": 1.0, "ledger": ledger, "seed": 1}
    return subprocess.Popen(
        [sys.executable, "-c", code, "producer", run, "--engine", url, "--reward",
         "strawq.producers.rewards.count_task", "--slots", "2", "--producer-id", pid,
         "--set", "sampling.max_new_tokens=200", "--set", "sampling.seed=5",
         "--set", "plugins.generate=strawq.demo.agentic_sim.sim_agent",
         "--set", f"plugins.generate_args={json.dumps(args)}",
         "--set", "timing.idle_poll_s=0.02",
         "--set", "timing.control_poll_s=0.02"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait(cond: Any, timeout: float, what: str, monitor: LeaseMonitor | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if monitor is not None:
            monitor.scan()
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: {what} not reached in {timeout:.0f}s")
        time.sleep(0.05)


def faults(rounds: int, groups: int) -> dict[str, int]:
    work = tempfile.mkdtemp(prefix="strawq-agentic-")
    run, ledger = os.path.join(work, "run"), os.path.join(work, "ledger")
    os.makedirs(run)
    q = RunQueue.create(PosixStorage(run, writer_id="setup"),
                        QueueConfig(group_size=4, lease_timeout_s=3.0, heartbeat_interval_s=0.2,
                                    release_batch=groups, max_attempts=20))
    data = os.path.join(work, "dataset.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(groups):
            f.write(json.dumps({"prompt": [5 + i % 50, 9, 11], "count": 3}) + "\n")
    Feeder(q, Dataset(data)).release(groups)
    control, monitor = Control(q.storage), LeaseMonitor(q)
    eng = start_engine_subprocess("sim", time_scale=0.02, len_median=20, len_cap=60,
                                  max_running_requests=64)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    persisted: set[str] = set()
    try:
        for k in range(2):
            procs[f"bench-p{k}"] = _producer(run, eng.url, ledger, f"bench-p{k}")
        for v in range(1, rounds + 1):
            before = sum(ledger_counts(ledger).values())
            _wait(lambda: sum(ledger_counts(ledger).values()) >= before + 4, 120,  # noqa: B023
                  "tool calls", monitor)
            control.pause(v)
            _wait(lambda: set(procs) <= set(control.state().acks), 120, "acks",  # noqa: B023
                  monitor)
            for t in _names(q, "pending") + _names(q, "partial"):
                if t.resume < 0:
                    continue
                rec = q._read_record(data_key(t.id, t.resume, "partial"), Kind.PARTIAL)
                for tr in GroupData.from_record(rec).meta.get("trajectories") or []:
                    persisted |= {e["key"] for e in Trajectory.from_dict(tr).tool_calls()}
            asyncio.run(_set_version(eng.url, v))
            q.set_version(v)
            control.resume(v)
            before = sum(ledger_counts(ledger).values())
            _wait(lambda: sum(ledger_counts(ledger).values()) >= before + 2,  # noqa: B023
                  120, "tool calls after the resume", monitor)
            victim = sorted(procs)[v % len(procs)]
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs.pop(victim).wait(timeout=30)
            procs[f"bench-r{v}"] = _producer(run, eng.url, ledger, f"bench-r{v}")
        _wait(lambda: len(q.storage.list("ready")) == groups, 600, "every group ready",
              monitor)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        eng.kill()
    counts = ledger_counts(ledger)
    trained: list[str] = []
    for name in q.storage.list("ready"):
        t = TaskName.try_parse(name)
        if t is None:
            continue
        grp = q.read_group(t.id, t.gen)
        for i in range(grp.num_samples):
            trajs = grp.meta.get("trajectories")
            c = grp.sample(i)
            tr = Trajectory.from_dict(trajs[i] if trajs else None, len(c["tokens"]))
            tr.check(len(c["tokens"]), c["loss_mask"])
            trained += [e["key"] for e in tr.tool_calls()]
    return {"groups": groups, "rounds": rounds, "tool_calls_trained": len(trained),
            "persisted": len(persisted),
            "reexecuted_persisted": sum(1 for k in persisted if counts[k] > 1),
            "reexecuted_in_flight": sum(1 for k in set(trained) - persisted if counts[k] > 1),
            "executions": sum(counts.values())}


async def _set_version(url: str, v: int) -> None:
    async with SGLangClient([url]) as client:
        await client.update_weight_version(v)


def lab(quick: bool, steps: int | None = None) -> tuple[str, float]:
    from strawq.demo.lab import LabConfig, format_table, run_lab

    # B = 12 groups: every schedule's micro-batch count must divide it (the lab's default,
    # 8 micro-batches, is for B = 96), so the streaming modes get 4 of 3 groups each
    kw: dict[str, Any] = dict(engines=8, concurrency=16, group_size=8, batch_groups=12,
                              micro_batches=4, flow_micro_batches=4,
                              steps=8, train_step_s=4.0, len_median=30,
                              agent_turns_p=0.5, agent_max_turns=5, tool_median_s=1.0,
                              tool_sigma=1.0, fsync=False, progress=False)
    if quick:  # the CI size: the path, not the figures (2 steps, 1 s steps, 0.2 s tools)
        kw.update(steps=2, train_step_s=1.0, tool_median_s=0.2)
    if steps is not None:
        kw.update(steps=steps)
    cfg = LabConfig(workdir=tempfile.mkdtemp(prefix="strawq-agentic-lab-"),
                    modes=("sync", "partial", "async"), **kw)
    result = run_lab(cfg)
    ratio = result.ratios().get("async", {}).get("throughput_x", float("nan"))
    return format_table(result), float(ratio)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="CI size: 2 rounds of 12 groups; a lab of 2 one-second steps")
    ap.add_argument("--rounds", type=int, default=None, help="fault rounds (default 3)")
    ap.add_argument("--groups", type=int, default=None, help="groups (default 24)")
    ap.add_argument("--steps", type=int, default=None, help="lab steps per mode (default 8)")
    ap.add_argument("--skip-lab", action="store_true")
    args = ap.parse_args()
    f = faults(rounds=args.rounds or (2 if args.quick else 3),
               groups=args.groups or (12 if args.quick else 24))
    print(json.dumps(f))
    ratio = float("nan")
    if not args.skip_lab:
        table, ratio = lab(args.quick, args.steps)
        print(table)
    print(f"agentic: tool calls re-executed after faults = {f['reexecuted_persisted']}, "
          f"async/sync = {ratio:.2f}")
    return 0 if f["reexecuted_persisted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
