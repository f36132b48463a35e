"""Agentic rollouts: tool calls re-executed after faults, and the three schedules on a
multi-turn case.

1. **Faults.** A sim engine, two producer *processes* running the simulated agent
   (``strawq.demo.agentic_sim``: turns and tool latency long-tailed; each tool execution
   leaves a ledger file named by its idempotency key). Each round: a weight update (every
   producer parks its groups as partials; the tool calls in those records are *persisted*),
   then a producer is killed with SIGKILL mid-trajectory and a new one started. At the end
   every group must be ready; N = persisted tool calls executed again after they were
   persisted (must be 0). Calls in flight at a kill run again with the same key; they are
   counted separately (and a call re-run so, then persisted, is not counted in N).
2. **Crashes, turn-level against update-level.** The stateful key-value agent
   (``strawq.demo.agentic_kv``: every turn followed by a tool call that writes into the
   sample's store, ``turns`` turns) on two producer processes, each run twice: with turn
   checkpoints (``tools.checkpoint_every_turns = 1``, the default) and without (``0``: only
   the update-level partials). K times a producer is killed with SIGKILL mid-trajectory and
   a new one started. Model tokens regenerated = tokens of completed live model turns − the
   generated tokens of the trained trajectories (work done, thrown away, done again; the
   tokens of a turn cut by the kill are in neither), per kill. Tool calls re-executed:
   calls whose result was saved (in a checkpoint or partial at the kill) that ran again.
   Environment mismatches: samples whose store disagreed with their recorded calls after
   a resume. The save cost per turn: bytes and storage operations of ``strawq.tasks.turns``
   (each publish is a create, a write, an fsync, a rename and a directory fsync).
3. **Schedules.** ``strawq lab`` on a multi-turn case (``agent_turns_p`` > 0), modes sync,
   partial and async: the lab's table and async/sync trained-token throughput.

    python bench/agentic.py [--quick] [--rounds R] [--groups N] [--steps S] [--skip-lab]

``--quick`` (the CI size): 2 fault rounds over 12 groups, 2 kills per crash run over 6
groups, and a lab of 2 one-second steps with 0.2 s tool calls and 3 turns at most, sync
and async only: it checks the path (the kills are real); its figures are not the
measurement.

Prints ``agentic: model tokens regenerated per producer kill = X (turn-level) vs Y
(update-level), tool calls re-executed = 0, environment mismatches = 0`` and, last,
``agentic: tool calls re-executed after faults = N, async/sync = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from strawq.data.dataset import Dataset  # noqa: E402
from strawq.data.feeder import Feeder  # noqa: E402
from strawq.demo.agentic_sim import ledger_counts  # noqa: E402
from strawq.ondisk.groups import GroupData  # noqa: E402
from strawq.ondisk.names import TaskName, data_key  # noqa: E402
from strawq.ondisk.records import Kind  # noqa: E402
from strawq.producers.engines.testing import start_engine_subprocess  # noqa: E402
from strawq.producers.sglang_client import SGLangClient  # noqa: E402
from strawq.producers.trajectory import Trajectory  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.grantor import LeaseMonitor  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402
from strawq.weights.control import Control  # noqa: E402


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


def _released_run(prefix: str, groups: int, *, lease_timeout_s: float, max_attempts: int
                  ) -> tuple[str, str, str, RunQueue]:
    """A fresh run (G = 4) with ``groups`` tool prompts released: (work, run, ledger, queue)."""
    work = tempfile.mkdtemp(prefix=prefix)
    run, ledger = os.path.join(work, "run"), os.path.join(work, "ledger")
    os.makedirs(run)
    q = RunQueue.create(PosixStorage(run, writer_id="setup"),
                        QueueConfig(group_size=4, lease_timeout_s=lease_timeout_s,
                                    heartbeat_interval_s=0.2, release_batch=groups,
                                    max_attempts=max_attempts))
    data = os.path.join(work, "dataset.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(groups):
            f.write(json.dumps({"prompt": [5 + i % 50, 9, 11], "count": 3}) + "\n")
    Feeder(q, Dataset(data)).release(groups)
    return work, run, ledger, q


def faults(rounds: int, groups: int) -> dict[str, int]:
    work, run, ledger, q = _released_run("strawq-agentic-", groups, lease_timeout_s=3.0,
                                         max_attempts=20)
    control, monitor = Control(q.storage), LeaseMonitor(q)
    eng = start_engine_subprocess("sim", time_scale=0.02, len_median=20, len_cap=60,
                                  max_running_requests=64)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    persisted: set[str] = set()
    at_persist: dict[str, int] = {}
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
                now = ledger_counts(ledger)
                for tr in GroupData.from_record(rec).meta.get("trajectories") or []:
                    for e in Trajectory.from_dict(tr).tool_calls():
                        if e["key"] not in persisted:  # a later execution is a re-run
                            at_persist[e["key"]] = now[e["key"]]
                            persisted.add(e["key"])
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
        tn = TaskName.try_parse(name)
        if tn is None:
            continue
        grp = q.read_group(tn.id, tn.gen)
        for i in range(grp.num_samples):
            trajs = grp.meta.get("trajectories")
            c = grp.sample(i)
            tr = Trajectory.from_dict(trajs[i] if trajs else None, len(c["tokens"]))
            tr.check(len(c["tokens"]), c["loss_mask"])
            trained += [e["key"] for e in tr.tool_calls()]
    return {"groups": groups, "rounds": rounds, "tool_calls_trained": len(trained),
            "persisted": len(persisted),
            "reexecuted_persisted": sum(1 for k in persisted if counts[k] > at_persist[k]),
            "reexecuted_in_flight": sum(1 for k in set(trained) - persisted if counts[k] > 1),
            "executions": sum(counts.values())}


KV_AGENT = "strawq.demo.agentic_kv.kv_agent"


def _kv_producer(run: str, url: str, ledger: str, pid: str, turns: int,
                 every_turns: int) -> subprocess.Popen[bytes]:
    code = ("import sys; sys.modules['ray'] = None; from strawq.app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = {"ledger": ledger, "turns": turns, "tool_s": 0.05}
    return subprocess.Popen(
        [sys.executable, "-c", code, "producer", run, "--engine", url, "--reward",
         "strawq.producers.rewards.count_task", "--slots", "4", "--producer-id", pid,
         "--set", f"sampling.max_new_tokens={turns * 40}", "--set", "sampling.seed=5",
         "--set", f"plugins.generate={KV_AGENT}",
         "--set", f"plugins.generate_args={json.dumps(args)}",
         "--set", f"tools.checkpoint_every_turns={every_turns}",
         "--set", "timing.idle_poll_s=0.02", "--set", "timing.control_poll_s=0.02"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})


def _saved(q: RunQueue) -> tuple[set[str], list[int]]:
    """Tool keys in every turn checkpoint and partial record now, and the checkpoints' sizes."""
    from strawq.ondisk import records
    from strawq.tasks.turns import TURNS_DIR

    keys: set[str] = set()
    sizes: list[int] = []
    groups: list[GroupData] = []
    for task in q.storage.list(TURNS_DIR):
        for n in q.storage.list(f"{TURNS_DIR}/{task}"):
            try:
                raw = q.storage.read(f"{TURNS_DIR}/{task}/{n}")
                rec = records.decode(raw)
            except Exception:  # noqa: BLE001 - removed under us
                continue
            if rec.kind is Kind.PARTIAL:
                sizes.append(len(raw))
                groups.append(GroupData.from_record(rec))
    for t in _names(q, "pending") + _names(q, "partial"):
        if t.resume >= 0:
            try:
                groups.append(GroupData.from_record(q._read_record(
                    data_key(t.id, t.resume, "partial"), Kind.PARTIAL)))
            except Exception:  # noqa: BLE001 - moved on under us
                continue
    for grp in groups:
        for tr in grp.meta.get("trajectories") or []:
            keys |= {e["key"] for e in Trajectory.from_dict(tr).tool_calls()}
    return keys, sizes


def crashes(kills: int, groups: int, turns: int, every_turns: int) -> dict[str, Any]:
    """One crash run (see the module docstring, 2.)."""
    from strawq.demo.agentic_kv import counts, live_turn_tokens

    work, run, ledger, q = _released_run("strawq-agentic-kill-", groups, lease_timeout_s=2.0,
                                         max_attempts=50)
    monitor = LeaseMonitor(q)
    eng = start_engine_subprocess("sim", time_scale=0.02, len_median=20, len_cap=40,
                                  max_running_requests=64)
    procs = {f"kill-p{k}": _kv_producer(run, eng.url, ledger, f"kill-p{k}", turns, every_turns)
             for k in range(2)}
    persisted: set[str] = set()
    at_persist: dict[str, int] = {}
    sizes: list[int] = []
    done = 0
    rng = random.Random(every_turns)
    try:
        for k in range(kills):
            before = sum(counts(ledger, "gen").values())
            _wait(lambda: sum(counts(ledger, "gen").values()) >= before + 12 and bool(  # noqa: B023
                q.storage.list("leased")), 120, "model turns", monitor)
            time.sleep(rng.uniform(0.0, 0.3))  # a random instant, not just after a turn
            victim = sorted(procs)[k % len(procs)]
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs.pop(victim).wait(timeout=30)
            keys, sz = _saved(q)
            now = counts(ledger, "exec")
            for key in keys - persisted:  # executions so far: a later one is a re-run
                at_persist[key] = now[key]
            persisted |= keys
            sizes += sz
            done += 1
            procs[f"kill-r{k}"] = _kv_producer(run, eng.url, ledger, f"kill-r{k}", turns,
                                               every_turns)
        _wait(lambda: len(q.storage.list("ready")) + len(q.storage.list("dropped")) == groups,
              600, "every group settled", monitor)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        eng.kill()
    trained_gen = 0
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
            trained_gen += sum(e["end"] - e["start"] for e in tr.events
                               if e["op"] == "gen" and e["end"] is not None)
    execs = counts(ledger, "exec")
    live = live_turn_tokens(ledger)
    return {"checkpoint_every_turns": every_turns, "kills": done, "groups": groups,
            "ready": len(q.storage.list("ready")), "turns": turns,
            "model_tokens_live": live, "model_tokens_trained": trained_gen,
            "regenerated_per_kill": round((live - trained_gen) / max(done, 1), 1),
            "tool_calls_reexecuted": sum(1 for k in persisted if execs[k] > at_persist[k]),
            "persisted_tool_calls": len(persisted),
            "env_mismatches": sum(counts(ledger, "mismatch").values()),
            "checkpoint_bytes_mean": round(sum(sizes) / len(sizes)) if sizes else 0}


def save_cost(samples: int = 4, turns: int = 10, saves: int = 40) -> dict[str, Any]:
    """What one turn checkpoint costs on a local fsync'd store: a group of ``samples``
    samples ``turns`` turns deep (40 generated + 1 appended token a turn, trajectories
    with tool events), saved ``saves`` times through ``strawq.tasks.turns.TurnLog``."""
    import numpy as np

    from strawq.ondisk.names import TaskName as Name
    from strawq.tasks.turns import TurnLog

    work = tempfile.mkdtemp(prefix="strawq-agentic-save-")
    st = PosixStorage(work, writer_id="bench", fsync=True)
    n = turns * 41
    events: list[dict[str, Any]] = []
    for t in range(turns):
        events += [{"op": "gen", "start": t * 41, "end": t * 41 + 40, "finish": "stop"},
                   {"op": "tool", "key": f"t.0.g0.e0.c{t}.0123456789abcdef", "name": "put",
                    "args": {"t": t, "k": f"k{t % 3}", "v": t}, "result": {"sum": t},
                    "attempts": 1, "seconds": 0.05, "started": 0.0},
                   {"op": "append", "start": t * 41 + 40, "end": t * 41 + 41, "kind": "tool"}]
    tr = {"schema": 1, "epoch": 0, "gen": 0, "events": events,
          "env": {"at": len(events), "state": {"k0": 1, "k1": 2, "k2": 3}}}
    z = np.zeros(n * samples)
    grp = GroupData(task_id="t", index=0, prompt_ids=np.arange(16), sample_lens=[n] * samples,
                    tokens=z, logprobs=z, versions=z, loss_mask=z, rewards=[None] * samples,
                    status=["pending"] * samples, meta={"trajectories": [tr] * samples})
    log = TurnLog(st, Name(key="b0.000000000001", id="t", gen=0, attempts=1, producer="p"))
    t0 = time.perf_counter()
    for _ in range(saves):
        log.save(grp)
    ms = (time.perf_counter() - t0) / saves * 1e3
    s = log.stats
    return {"samples": samples, "turns": turns, "bytes_per_save": s.bytes // s.saves,
            "publishes_per_save": s.publishes / s.saves, "deletes_per_save":
            round(s.deletes / s.saves, 2), "ms_per_save": round(ms, 2),
            "fsyncs_per_save": 2 * s.publishes / s.saves}


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
    modes: tuple[str, ...] = ("sync", "partial", "async")
    if quick:  # the CI size: the path, not the figures (2 steps, 1 s steps, 0.2 s tools,
        # 3 turns at most; sync and async only: the ratio the last line prints)
        kw.update(steps=2, train_step_s=1.0, tool_median_s=0.2, agent_max_turns=3)
        modes = ("sync", "async")
    if steps is not None:
        kw.update(steps=steps)
    cfg = LabConfig(workdir=tempfile.mkdtemp(prefix="strawq-agentic-lab-"), modes=modes, **kw)
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
    ap.add_argument("--kills", type=int, default=None,
                    help="SIGKILLs per crash run (default 6; --quick 2)")
    ap.add_argument("--skip-lab", action="store_true")
    args = ap.parse_args()
    f = faults(rounds=args.rounds or (2 if args.quick else 3),
               groups=args.groups or (12 if args.quick else 24))
    print(json.dumps(f))
    kills = args.kills or (2 if args.quick else 6)
    kgroups, kturns = (6, 6) if args.quick else (16, 10)
    turn_level = crashes(kills, kgroups, kturns, every_turns=1)
    print(json.dumps(turn_level))
    update_level = crashes(kills, kgroups, kturns, every_turns=0)
    print(json.dumps(update_level))
    cost = save_cost(turns=kturns)
    print(json.dumps({"save_cost": cost}))
    bad = (turn_level["tool_calls_reexecuted"] + turn_level["env_mismatches"]
           + update_level["env_mismatches"])
    print(f"agentic: model tokens regenerated per producer kill = "
          f"{turn_level['regenerated_per_kill']:g} (turn-level) vs "
          f"{update_level['regenerated_per_kill']:g} (update-level), tool calls re-executed = "
          f"{turn_level['tool_calls_reexecuted']}, environment mismatches = "
          f"{turn_level['env_mismatches'] + update_level['env_mismatches']}; a save: "
          f"{cost['bytes_per_save']} B, {cost['publishes_per_save']:g} publish "
          f"(+{cost['deletes_per_save']:g} delete), {cost['ms_per_save']:g} ms")
    ratio = float("nan")
    if not args.skip_lab:
        table, ratio = lab(args.quick, args.steps)
        print(table)
    print(f"agentic: tool calls re-executed after faults = {f['reexecuted_persisted']}, "
          f"async/sync = {ratio:.2f}")
    return 0 if f["reexecuted_persisted"] == 0 and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
