"""Benchmark of the producers: ready groups/s, slot utilisation, CPU per group.

    python bench/producers.py [--quick]

One sim engine (a separate process, time-scaled timing model with long-tailed response
lengths) with C concurrent slots; K = floor(C*E/G) group slots split by divmod over W = 1,
2 and 4 producers. Each producer runs in its own process, standing in for a node (the Ray
actor wrapper adds nothing on the hot path; placement is tested in
``tests/producers/test_placement.py``). The run directory is a local disk with fsync on.

Every prompt is released before the producers start; the measurement window runs from a
common start signal until the queue has no pending task left ("while the queue has
work"): then the producers are stopped (they park their groups as partials). Reported per
W: ready groups/s, trajectory-slot utilisation (busy trajectory-slot-seconds over
slots x G x wall time, capacity-weighted over producers), and producer CPU seconds per
finished group. The last line is ``producers: slot utilisation = X%`` for W = 4.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strawq.config import QueueConfig  # noqa: E402
from strawq.data.dataset import Dataset  # noqa: E402
from strawq.data.feeder import Feeder  # noqa: E402
from strawq.producers.budget import split_budget  # noqa: E402
from strawq.producers.engines.testing import start_engine_subprocess  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402
from strawq.tasks.states import TaskState, names_in  # noqa: E402


def producer_main(cfg: dict[str, Any], go: str, stop: str, out: str) -> None:
    import asyncio
    import logging

    logging.basicConfig(level=logging.WARNING)
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import ProducerConfig

    producer = Producer(ProducerConfig.from_dict(cfg))

    async def main() -> None:
        while not os.path.exists(go):
            await asyncio.sleep(0.01)
        producer.reset_stats_window()
        task = asyncio.create_task(producer.run())
        while not os.path.exists(stop) and not task.done():
            await asyncio.sleep(0.02)
        snap = producer.stats().to_dict()  # the window while the queue had work
        producer.request_stop()
        await task
        Path(out).write_text(json.dumps(snap))

    asyncio.run(main())


def pending_count(q: RunQueue) -> int:
    return len(q.list_pending())


def ready_count(q: RunQueue) -> int:
    return len(names_in(q.storage, TaskState.READY))


def run_case(workdir: Path, url: str, n_prompts: int, producers: int, c: int, g: int,
             max_new: int, eager: bool) -> dict[str, Any]:
    run = workdir / f"run-w{producers}"
    q = RunQueue.create(PosixStorage(str(run), writer_id="bench"),
                        QueueConfig(group_size=g, release_batch=n_prompts,
                                    lease_timeout_s=60, heartbeat_interval_s=2.0))
    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [3 + i % 97, 5, 7], "target": 9,
                                        "count": 3}) + "\n" for i in range(n_prompts)))
    Feeder(q, Dataset(str(data))).release(n_prompts)
    budget = split_budget(c, 1, g, producers)
    go, stop = str(workdir / f"go-{producers}"), str(workdir / f"stop-{producers}")
    procs, outs = [], []
    ctx = mp.get_context("spawn")
    for i, slots in enumerate(budget.slots):
        cfg = {"run_dir": str(run), "producer_id": f"bench-w{producers}-{i}",
               "engine": {"workers": [url]},
               "plugins": {"reward": "strawq.producers.rewards.count_task"},
               "budget": {"slots": slots, "eager_claim": eager},
               "sampling": {"max_new_tokens": max_new, "seed": i},
               "timing": {"control_poll_s": 0.2, "idle_poll_s": 0.05}}
        out = str(workdir / f"stats-{producers}-{i}.json")
        p = ctx.Process(target=producer_main, args=(cfg, go, stop, out), daemon=True)
        p.start()
        procs.append(p)
        outs.append(out)
    time.sleep(2.0 + producers * 0.5)  # let the spawned interpreters import everything
    ready0 = ready_count(q)
    Path(go).touch()
    t0 = time.perf_counter()
    deadline = t0 + 600
    while pending_count(q) > 0 and time.perf_counter() < deadline:
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    ready = ready_count(q) - ready0
    Path(stop).touch()
    for p in procs:
        p.join(120)
    stats = [json.loads(Path(o).read_text()) for o in outs if os.path.exists(o)]
    cap = sum(s["slots"] for s in stats)
    util = sum(s["slot_utilisation"] * s["slots"] for s in stats) / cap if cap else 0.0
    done = sum(s["groups_done"] for s in stats)
    cpu = sum(s["cpu_s"] for s in stats)
    samples = sum(s["samples_finished"] for s in stats)
    return {"producers": producers, "slots": list(budget.slots), "K": budget.total,
            "ready_groups": ready, "elapsed_s": elapsed, "groups_per_s": ready / elapsed,
            "utilisation": util, "samples_per_s": samples / elapsed,
            "cpu_ms_per_group": 1000 * cpu / done if done else None,
            "ready_after_stop": ready_count(q) - ready0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts (CI smoke run)")
    ap.add_argument("--strict-claim", action="store_true",
                    help="claim only whole groups (ProducerConfig.budget.eager_claim=False)")
    args = ap.parse_args()
    c, g = 128, 8  # K = 128 // 8 = 16 group slots
    n_prompts = 96 if args.quick else 320
    sim = {"time_scale": 0.05, "len_median": 100 if args.quick else 200, "len_sigma": 1.0,
           "len_cap": 1024, "cap_prob": 0.02}
    max_new = 1024
    workdir = Path(tempfile.mkdtemp(prefix="strawq-bench-producers-"))
    rows = []
    try:
        with start_engine_subprocess("sim", max_running_requests=c, **sim) as eng:
            for w in (1, 2, 4):
                rows.append(run_case(workdir, eng.url, n_prompts, w, c, g, max_new,
                                     not args.strict_claim))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"sim engine: C={c}, E=1, G={g} -> K={c // g}; {n_prompts} prompts; "
          f"sim {sim}; cores={os.cpu_count()}; "
          f"claim={'strict' if args.strict_claim else 'eager'}")
    print(f"{'W':>2}  {'slots':<16} {'ready/s':>8} {'samples/s':>9} {'util %':>7} "
          f"{'cpu ms/group':>13} {'window s':>9}")
    for r in rows:
        cpu = "-" if r["cpu_ms_per_group"] is None else f"{r['cpu_ms_per_group']:.1f}"
        print(f"{r['producers']:>2}  {str(r['slots']):<16} {r['groups_per_s']:>8.2f} "
              f"{r['samples_per_s']:>9.1f} {100 * r['utilisation']:>7.1f} {cpu:>13} "
              f"{r['elapsed_s']:>9.1f}")
    four = next(r for r in rows if r["producers"] == 4)
    print(f"producers: slot utilisation = {100 * four['utilisation']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
