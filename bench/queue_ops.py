"""Queue operations: strawq vs straw-queue 0.1.6, side by side in one run.

Workload (both systems, same durability: every payload and every state change fsync'd):
P producer *processes* each loop  claim 1 task -> write a group of G samples x T tokens
(tokens int32, log-probs float32, versions int64, loss mask uint8) -> complete;
one collector in the parent scans finished groups, reads and verifies each payload,
commits them in batches and garbage-collects. Throughput = groups collected per second
from the start barrier to the last group collected. Claim latency is measured in the
producers around the claim call (strawq: rename from the shared directory; straw:
``acquire`` through its coordinator's RPC, its only multi-process path).

Also: per-operation cost over a long run (``--flat N`` groups through one run, small
payloads, GC on), in windows, to show cost does not grow with history.

    python bench/queue_ops.py            # full: P in 1,4,16; local dir (+ JuiceFS if mounted)
    python bench/queue_ops.py --quick    # CI-sized smoke run

The last line is ``queue_ops: strawq/straw throughput ratio = X`` (geometric mean).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strawq.batches import BatchStore  # noqa: E402
from strawq.config import QueueConfig  # noqa: E402
from strawq.dataset import Dataset  # noqa: E402
from strawq.feeder import Feeder  # noqa: E402
from strawq.groups import GroupData  # noqa: E402
from strawq.queue import RunQueue  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1)))]


def make_columns(samples: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = samples * tokens
    return {
        "tokens": rng.integers(0, 50000, n, dtype=np.int32),
        "logprobs": rng.standard_normal(n).astype(np.float32),
        "versions": np.zeros(n, dtype=np.int64),
        "loss_mask": np.ones(n, dtype=np.uint8),
    }


class Workers:
    """P producer processes released together at a start time; their stats on exit."""

    def __init__(self, target: Any, n: int, args: Any) -> None:
        ctx = mp.get_context("fork")
        self.out = ctx.Queue()
        self.start_at = time.time() + 0.5
        self.procs = [ctx.Process(target=target, args=args(i, self.start_at, self.out))
                      for i in range(n)]
        self.stats: list[dict[str, Any]] = []

    def __enter__(self) -> Workers:
        for p in self.procs:
            p.start()
        while time.time() < self.start_at:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stats = [self.out.get(timeout=60) for _ in self.procs]
        for p in self.procs:
            p.join(30)


# -- strawq -----------------------------------------------------------------------------------
def strawq_worker(root: str, pid: int, start_at: float, samples: int, tokens: int,
                  out: Any) -> None:
    q = RunQueue.open(PosixStorage(root, writer_id=f"p{pid}"))
    cols = make_columns(samples, tokens, pid)
    lat: list[float] = []
    done = 0
    while time.time() < start_at:
        time.sleep(0.001)
    producer = f"p{pid}"
    while True:
        t0 = time.perf_counter()
        leases = q.claim(producer, 1)
        lat.append(time.perf_counter() - t0)
        if not leases:
            break
        lease = leases[0]
        g = GroupData(task_id=lease.task_id, index=lease.task["index"], prompt_ids=[1, 2, 3],
                      sample_lens=[tokens] * samples, rewards=[1.0] * samples,
                      status=["completed"] * samples, **cols)
        q.complete(lease, g)
        done += 1
        if done % 16 == 0:
            q.heartbeat(producer)
    out.put({"claims": lat, "done": done})


def strawq_collect(q: RunQueue, total: int, batch: int = 64) -> tuple[int, int]:
    bs = BatchStore(q)
    collected = nbytes = 0
    seq = bs.next_seq()
    stop = threading.Event()

    def gc_loop() -> None:  # the collector garbage-collects off its hot path
        while not stop.wait(0.05):
            BatchStore(q).gc()

    gc_thread = threading.Thread(target=gc_loop, daemon=True)
    gc_thread.start()
    while collected < total:
        names = bs.scan_ready()[:batch]
        if not names:
            time.sleep(0.002)
            continue
        for name in names:
            g = q.read_group(name.id, name.gen)  # read + verify checksum
            nbytes += g.tokens.nbytes + g.logprobs.nbytes + g.versions.nbytes + g.loss_mask.nbytes
        bs.publish_batch(seq, names)
        bs.ack(seq)
        seq += 1
        collected += len(names)
    stop.set()
    gc_thread.join()
    bs.gc()
    return collected, nbytes


def write_dataset(path: str, n: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": [1, 2, 3], "i": i}) + "\n")


def new_run(base: str, tag: str, groups: int, release_batch: int
            ) -> tuple[str, RunQueue, Feeder]:
    """A fresh run with a dataset of ``groups`` prompts (leases long enough to never expire)."""
    root = os.path.join(base, f"{tag}-{secrets.token_hex(3)}")
    os.makedirs(root)
    ds = os.path.join(root, "ds.jsonl")
    write_dataset(ds, groups)
    q = RunQueue.create(PosixStorage(os.path.join(root, "run"), writer_id="c"),
                        QueueConfig(release_batch=release_batch, lease_timeout_s=600,
                                    heartbeat_interval_s=10))
    return root, q, Feeder(q, Dataset(ds))


def run_strawq(base: str, producers: int, groups: int, samples: int, tokens: int
               ) -> dict[str, float]:
    root, q, feeder = new_run(base, f"strawq-{producers}", groups, 64)
    while feeder.release():  # release directories of 64, as a collector would
        pass
    with Workers(strawq_worker, producers,
                 lambda i, at, out: (os.path.join(root, "run"), i, at, samples, tokens, out)) as w:
        t0 = time.perf_counter()
        collected, nbytes = strawq_collect(q, groups)
        elapsed = time.perf_counter() - t0
    stats = w.stats
    claims = [x for s in stats for x in s["claims"]]
    shutil.rmtree(root, ignore_errors=True)
    if collected != groups or sum(s["done"] for s in stats) != groups:
        raise RuntimeError(f"strawq lost or duplicated work: {collected} collected, "
                           f"{sum(s['done'] for s in stats)} completed, {groups} released")
    return {"groups_s": groups / elapsed, "claim_p50_ms": pct(claims, 0.5) * 1e3,
            "claim_p99_ms": pct(claims, 0.99) * 1e3, "mib_s": nbytes / elapsed / 2**20}


# -- straw-queue 0.1.6 ---------------------------------------------------------------------------
def straw_worker(root: str, address: str, token: str, pid: int, start_at: float, samples: int,
                 tokens: int, out: Any) -> None:
    from straw import Record, SharedFilesystemStore
    from straw.protocol import Lease
    from straw.rpc import QueueClient

    cols = make_columns(samples, tokens, pid)
    blobs = [c.tobytes() for c in cols.values()]
    client = QueueClient(address, token=token)
    store = SharedFilesystemStore(Path(root) / "queue", "bench",
                                  max_buffer_bytes=sum(map(len, blobs)) + 8 * 2**20)
    lat: list[float] = []
    done = 0
    while time.time() < start_at:
        time.sleep(0.001)
    while True:
        t0 = time.perf_counter()
        page = client.call("acquire", worker_id=f"w{pid}", max_tasks=1)
        lat.append(time.perf_counter() - t0)
        if not page["assignments"]:
            break
        lease = Lease(**page["assignments"][0]["lease"])
        ref = store.publish([Record(f"{lease.task_id}:{i}", b,
                                    metadata={"task_id": lease.task_id,
                                              "attempt_id": lease.attempt_id})
                             for i, b in enumerate(blobs)], submission_id=lease.task_id)
        client.call("complete_task", lease=lease, submission_id=lease.task_id, result_ref=ref,
                    result_digest=ref.digest)
        done += 1
    store.close()
    out.put({"claims": lat, "done": done})


def run_straw(base: str, producers: int, groups: int, samples: int, tokens: int
              ) -> dict[str, float]:
    from straw import Coordinator, Limits, RecordSetRef, SharedFilesystemStore, TaskSpec
    from straw.rpc import serve

    root = Path(base) / f"straw-{producers}-{secrets.token_hex(3)}"
    root.mkdir()
    token = secrets.token_hex(16)
    size = samples * tokens * (4 + 4 + 8 + 1)
    store = SharedFilesystemStore(root / "queue", "bench", max_buffer_bytes=size + 8 * 2**20)
    coord = Coordinator(store, limits=Limits(pending_tasks=max(10000, groups),
                                             inflight_tasks=256,
                                             accepted_bytes=groups * size * 2 + 2**30,
                                             accepted_records=10**7,
                                             max_result_bytes=size + 8 * 2**20),
                        exclusive_owner="bench", lease_seconds=600)
    addr: list[Any] = []
    ready = threading.Event()
    threading.Thread(target=serve, args=(coord, ("127.0.0.1", 0)),
                     kwargs={"token": token, "ready": lambda a: (addr.append(a), ready.set())},
                     daemon=True).start()
    ready.wait(30)
    address = f"http://127.0.0.1:{addr[0][1]}"
    for start in range(0, groups, 128):
        coord.submit_tasks(f"s{start}", [TaskSpec(f"t{i}", estimated_bytes=size)
                                         for i in range(start, min(groups, start + 128))])
    coord.seal_input("all")
    from straw.rpc import QueueClient

    client = QueueClient(address, token=token)
    with Workers(straw_worker, producers,
                 lambda i, at, out: (str(root), address, token, i, at, samples, tokens, out)) as w:
        t0 = time.perf_counter()
        cursor = collected = nbytes = 0
        while collected < groups:
            page = client.call("read_commits", cursor=cursor, limit=64)
            for receipt in page["commits"]:
                ref = RecordSetRef.from_dict(receipt["result_ref"])
                nbytes += sum(len(r.payload) for r in store.read(ref))
                collected += 1
            cursor = page["cursor"]
            if not page["commits"]:
                time.sleep(0.002)
        elapsed = time.perf_counter() - t0
    stats = w.stats
    store.close()
    coord.close()
    shutil.rmtree(root, ignore_errors=True)
    claims = [x for s in stats for x in s["claims"]]
    return {"groups_s": groups / elapsed, "claim_p50_ms": pct(claims, 0.5) * 1e3,
            "claim_p99_ms": pct(claims, 0.99) * 1e3, "mib_s": nbytes / elapsed / 2**20}


# -- flatness ----------------------------------------------------------------------------------
def run_flat(base: str, total: int, window: int) -> list[dict[str, float]]:
    """One producer and one collector in a loop; cost per group in windows of ``window``."""
    root, q, feeder = new_run(base, "flat", total, 256)
    bs = BatchStore(q)
    cols = make_columns(2, 16, 0)
    rows = []
    done = 0
    seq = 1
    t0 = time.perf_counter()
    while done < total:
        if not q.list_pending(limit=1):
            feeder.release(256)
        leases = q.claim("p0", 16)
        for lease in leases:
            g = GroupData(task_id=lease.task_id, index=lease.task["index"], prompt_ids=[1],
                          sample_lens=[16, 16], rewards=[1.0, 0.0],
                          status=["completed"] * 2, **cols)
            q.complete(lease, g)
        names = bs.scan_ready()
        for name in names:
            bs.read_summary(name)
        if names:
            bs.publish_batch(seq, names)
            bs.ack(seq)
            bs.gc()
            seq += 1
        before = done
        done += len(names)
        if done // window != before // window:
            t1 = time.perf_counter()
            files = sum(len(os.listdir(os.path.join(root, "run", d)))
                        for d in ("ready", "batched", "data", "batches", "leased"))
            rows.append({"groups": done, "us_per_group": (t1 - t0) / (done - before_w(rows))
                         * 1e6, "live_files": files})
            t0 = t1
    shutil.rmtree(root, ignore_errors=True)
    return rows


def before_w(rows: list[dict[str, float]]) -> int:
    return int(rows[-1]["groups"]) if rows else 0


# -- main ---------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--producers", default=None, help="comma list, default 1,4,16")
    ap.add_argument("--groups", type=int, default=None, help="groups per case")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--flat", type=int, default=None, help="groups for the flatness run")
    ap.add_argument("--juicefs", default=os.environ.get("STRAWQ_JUICEFS_A"),
                    help="a JuiceFS mount to run on too (default $STRAWQ_JUICEFS_A)")
    ap.add_argument("--flat-only", action="store_true", help="only the flatness run")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    producers = [int(x) for x in (args.producers or ("1,4" if args.quick else "1,4,16"))
                 .split(",")]
    groups = args.groups or (64 if args.quick else 512)
    flat = args.flat if args.flat is not None else (2000 if args.quick else 100_000)
    locations = [("local", tempfile.mkdtemp(prefix="strawq-bench-"))]
    if args.juicefs and os.path.isdir(args.juicefs):
        jd = os.path.join(args.juicefs, f"bench-{secrets.token_hex(3)}")
        os.makedirs(jd)
        locations.append(("juicefs", jd))
    results: list[dict[str, Any]] = []
    print(f"workload: groups of {args.samples} samples x {args.tokens} tokens "
          f"({args.samples * args.tokens * 17 / 2**10:.0f} KiB of columns), {groups} groups "
          f"per case, fsync on", flush=True)
    hdr = (f"{'fs':<8}{'P':>3} | {'strawq g/s':>11}{'claim p50':>10}{'p99 ms':>8} | "
           f"{'straw g/s':>10}{'claim p50':>10}{'p99 ms':>8} | {'ratio':>6}")
    print(hdr)
    print("-" * len(hdr))
    for loc, base in ([] if args.flat_only else locations):
        for p in producers:
            a = run_strawq(base, p, groups, args.samples, args.tokens)
            b = run_straw(base, p, groups, args.samples, args.tokens)
            ratio = a["groups_s"] / b["groups_s"]
            results.append({"fs": loc, "producers": p, "strawq": a, "straw": b, "ratio": ratio})
            print(f"{loc:<8}{p:>3} | {a['groups_s']:>11.1f}{a['claim_p50_ms']:>10.2f}"
                  f"{a['claim_p99_ms']:>8.2f} | {b['groups_s']:>10.1f}{b['claim_p50_ms']:>10.2f}"
                  f"{b['claim_p99_ms']:>8.2f} | {ratio:>6.2f}", flush=True)
    flat_rows: list[dict[str, float]] = []
    if flat:
        window = max(flat // 10, 1)
        flat_rows = run_flat(locations[0][1], flat, window)
        print(f"\nflatness: {flat} groups through one run (local, 2x16-token groups, GC on)")
        print(f"{'groups':>9} {'us/group':>9} {'live files':>11}")
        for r in flat_rows:
            print(f"{int(r['groups']):>9} {r['us_per_group']:>9.0f} {int(r['live_files']):>11}")
        costs = [r["us_per_group"] for r in flat_rows]
        first, last = costs[0], costs[-1]
        print(f"last/first window cost = {last / first:.2f}; max/min = "
              f"{max(costs) / min(costs):.2f}; live files stay at "
              f"{max(int(r['live_files']) for r in flat_rows)} or fewer")
    if not results:
        return 0
    for _loc, base in locations:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cases": results, "flat": flat_rows}, f, indent=2)
    gm = math.exp(sum(math.log(r["ratio"]) for r in results) / len(results))
    print(f"queue_ops: strawq/straw throughput ratio = {gm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
