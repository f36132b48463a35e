"""Queue operations: strawq vs straw-queue 0.1.6 vs the filesystem's limit, in one run.

Workload (both systems, same durability: every payload and every state change fsync'd):
P producer *processes* each loop  claim 1 task -> write a group of G samples x T tokens
(tokens int32, log-probs float32, versions int64, loss mask uint8) -> complete;
one collector in the parent scans finished groups, reads and verifies each payload,
commits them in batches and garbage-collects. Throughput = groups collected per second
from the start barrier to the last group collected. Claim latency is measured in the
producers around the claim call (strawq: rename from the shared directory; straw:
``acquire`` through its coordinator's RPC, its only multi-process path).

The third system is the yardstick: the bare durable protocol, with the same payloads (the
same GROUP record bytes) and the same consumer. Each producer writes its share of groups
(no claim: work is pre-partitioned) with write + fsync + rename + directory fsync; the
consumer lists, reads and verifies each record (checksum and decode, as strawq's) and
deletes it. Nothing a queue adds — claims, leases, manifests, acks, names — is in it, so
strawq ÷ limit says what the queue costs on top of the filesystem.

On JuiceFS the bench also counts metadata operations per group from the client's own
counters (``<mount>/.stats``: ``juicefs_meta_ops_total_<op>``, every operation the mount
sent to its metadata engine while the case ran, producers and consumer together).

Also: per-operation cost over a long run (``--flat N`` groups through one run, small
payloads, GC on), in windows, to show cost does not grow with history.

    python bench/queue_ops.py            # full: P in 1,4,16; local dir (+ JuiceFS if mounted)
    python bench/queue_ops.py --quick    # CI-sized smoke run

JuiceFS volumes: ``--juicefs`` (default ``$STRAWQ_JUICEFS_A``) and ``--juicefs-redis``
(default ``$STRAWQ_JUICEFS_REDIS_A``: a volume on Redis metadata, the engine production
uses, e.g. ``META=redis deploy/juicefs/testvol.sh up DIR``), each row labelled with the
metadata engine its client names (``strawq doctor``'s reading), and a summary line per
location before the last line. ``--up`` brings both volumes up for the run itself (fresh,
in a temporary directory, taken down at the end) and on the Redis one also counts what
reached the server (``INFO commandstats``, commands per group, Lua scripts' inner calls
included) beside the client's counters: local disk, SQLite and Redis metadata in one run,
each with its limit measured in the same run. On a Redis volume already mounted,
``--redis-sock SOCK`` (the server's unix socket) counts the server's commands the same way.

    python bench/queue_ops.py --up --flat 0   # local, JuiceFS on SQLite, JuiceFS on Redis
    python bench/queue_ops.py --quick --juicefs-redis DIR/A --redis-sock DIR/redis/redis.sock

The last line is ``queue_ops: strawq/limit = X, strawq/straw = Y, meta ops/group = Z,
release_chunk = K, chunk leases = N``
(geometric means over the cases; Z is strawq's mean on JuiceFS, ``n/a`` without it).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis_meta import Unavailable, commandstats, test_volume  # noqa: E402
from redis_meta import delta as calls_delta  # noqa: E402

from strawq.config import QueueConfig  # noqa: E402
from strawq.data.dataset import Dataset  # noqa: E402
from strawq.data.feeder import Feeder  # noqa: E402
from strawq.delivery.batches import BatchStore  # noqa: E402
from strawq.ondisk.groups import GroupData  # noqa: E402
from strawq.ondisk.records import Kind, decode  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402


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
                  out: Any, batch: int = 1) -> None:
    q = RunQueue.open(PosixStorage(root, writer_id=f"p{pid}"))
    cols = make_columns(samples, tokens, pid)
    lat: list[float] = []
    done = chunked = 0
    while time.time() < start_at:
        time.sleep(0.001)
    producer = f"p{pid}"
    while True:
        t0 = time.perf_counter()
        leases = q.claim(producer, batch)
        lat.append(time.perf_counter() - t0)
        if not leases:
            break
        for lease in leases:
            chunked += lease.name.chunk is not None
            g = GroupData(task_id=lease.task_id, index=lease.task["index"],
                          prompt_ids=[1, 2, 3], sample_lens=[tokens] * samples,
                          rewards=[1.0] * samples, status=["completed"] * samples, **cols)
            q.complete(lease, g)
            done += 1
            if done % 16 == 0:
                q.heartbeat(producer)
    out.put({"claims": lat, "done": done, "chunked": chunked})


#: how often the bench's collector garbage-collects: the collector's own default
#: (``CollectorConfig.gc_interval_s``); ``--gc-interval`` sets it
GC_INTERVAL_S = 1.0


def strawq_collect(q: RunQueue, total: int, batch: int = 64) -> tuple[int, int]:
    bs = BatchStore(q)
    collected = nbytes = 0
    seq = bs.next_seq()
    stop = threading.Event()

    def gc_loop() -> None:  # the collector garbage-collects off its hot path
        while not stop.wait(GC_INTERVAL_S):
            BatchStore(q).gc()

    gc_thread = threading.Thread(target=gc_loop, daemon=True)
    gc_thread.start()
    read: dict[str, Any] = {}  # read and verified, waiting for their batch
    while collected < total:
        fresh = [n for n in bs.scan_ready() if n.id not in read]
        for name in fresh:
            g = q.read_group(name.id, name.gen)  # read + verify checksum
            nbytes += g.tokens.nbytes + g.logprobs.nbytes + g.versions.nbytes + g.loss_mask.nbytes
            read[name.id] = name
        # batches of ``batch`` groups, as a collector forms them (a short last one)
        if len(read) < min(batch, total - collected):
            if not fresh:
                time.sleep(0.002)
            continue
        names = list(read.values())[:batch]
        bs.publish_batch(seq, names)
        bs.ack(seq)
        for name in names:
            del read[name.id]
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


def new_run(base: str, tag: str, groups: int, release_batch: int, release_chunk: int = 1
            ) -> tuple[str, RunQueue, Feeder]:
    """A fresh run with a dataset of ``groups`` prompts (leases long enough to never expire)."""
    root = os.path.join(base, f"{tag}-{secrets.token_hex(3)}")
    os.makedirs(root)
    ds = os.path.join(root, "ds.jsonl")
    write_dataset(ds, groups)
    q = RunQueue.create(PosixStorage(os.path.join(root, "run"), writer_id="c"),
                        QueueConfig(release_batch=release_batch, release_chunk=release_chunk,
                                    lease_timeout_s=600,
                                    heartbeat_interval_s=10))
    return root, q, Feeder(q, Dataset(ds))


def run_strawq(base: str, producers: int, groups: int, samples: int, tokens: int,
               release_chunk: int = 1) -> dict[str, float]:
    """``release_chunk`` K: the release stages chunks of K tasks and each producer claims K
    tasks at a time (a claim that wants a whole chunk takes it by one rename); K = 1 is one
    task per claim, as before."""
    root, q, feeder = new_run(base, f"strawq-{producers}", groups, 64, release_chunk)
    while feeder.release():  # release directories of 64, as a collector would
        pass
    with Workers(strawq_worker, producers,
                 lambda i, at, out: (os.path.join(root, "run"), i, at, samples, tokens, out,
                                     release_chunk)) as w:
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
            "claim_p99_ms": pct(claims, 0.99) * 1e3, "mib_s": nbytes / elapsed / 2**20,
            "chunked": float(sum(s["chunked"] for s in stats))}


# -- the limit: the bare durable protocol -------------------------------------------------------
def limit_record(pid: int, index: int, samples: int, tokens: int,
                 cols: dict[str, np.ndarray]) -> list[bytes]:
    """The same GROUP record bytes strawq's producers publish for this group."""
    g = GroupData(task_id=f"i{index:012d}", index=index, prompt_ids=[1, 2, 3],
                  sample_lens=[tokens] * samples, rewards=[1.0] * samples,
                  status=["completed"] * samples, **cols)
    return g.encode(Kind.GROUP)


def limit_worker(root: str, pid: int, producers: int, groups: int, start_at: float,
                 samples: int, tokens: int, out: Any) -> None:
    st = PosixStorage(root, writer_id=f"p{pid}")
    cols = make_columns(samples, tokens, pid)
    lat: list[float] = []
    done = 0
    while time.time() < start_at:
        time.sleep(0.001)
    for index in range(pid, groups, producers):
        body = limit_record(pid, index, samples, tokens, cols)
        t0 = time.perf_counter()
        # tmp write + fsync + close + rename (no replace) + fsync of ready/
        st.publish(f"ready/g{index:012d}", body)
        lat.append(time.perf_counter() - t0)
        done += 1
    out.put({"claims": lat, "done": done})


def run_limit(base: str, producers: int, groups: int, samples: int, tokens: int
              ) -> dict[str, float]:
    root = os.path.join(base, f"limit-{producers}-{secrets.token_hex(3)}")
    st = PosixStorage(root, writer_id="c")
    st.makedirs("ready")
    with Workers(limit_worker, producers,
                 lambda i, at, out: (root, i, producers, groups, at, samples, tokens, out)) as w:
        t0 = time.perf_counter()
        collected = nbytes = 0
        while collected < groups:
            names = st.list("ready")
            if not names:
                time.sleep(0.002)
                continue
            for name in names:
                key = f"ready/{name}"
                g = GroupData.from_record(decode(st.read(key), expect=Kind.GROUP, name=key))
                nbytes += g.tokens.nbytes + g.logprobs.nbytes + g.versions.nbytes + \
                    g.loss_mask.nbytes
                st.delete(key)  # consumed: the payload goes (strawq's GC)
                collected += 1
        elapsed = time.perf_counter() - t0
    stats = w.stats
    shutil.rmtree(root, ignore_errors=True)
    if collected != groups or sum(s["done"] for s in stats) != groups:
        raise RuntimeError(f"limit run: {collected} collected, "
                           f"{sum(s['done'] for s in stats)} written, {groups} expected")
    pubs = [x for s in stats for x in s["claims"]]
    return {"groups_s": groups / elapsed, "publish_p50_ms": pct(pubs, 0.5) * 1e3,
            "publish_p99_ms": pct(pubs, 0.99) * 1e3, "mib_s": nbytes / elapsed / 2**20}


# -- JuiceFS client counters ---------------------------------------------------------------------
def meta_ops(mount: str | None) -> dict[str, float]:
    """The mount's cumulative metadata operations by kind (empty when not JuiceFS)."""
    if mount is None:
        return {}
    try:
        with open(os.path.join(mount, ".stats"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("juicefs_meta_ops_total_"):
            name, _, value = line.partition(" ")
            out[name[len("juicefs_meta_ops_total_"):]] = float(value)
    return out


#: the Redis server behind a mount this run brought up (``--up``): its own command count
REDIS_SOCKS: dict[str, str] = {}


def redis_calls(mount: str | None) -> dict[str, int]:
    sock = REDIS_SOCKS.get(mount or "")
    return commandstats(sock) if sock else {}


def counted(mount: str | None, fn: Any, *args: Any) -> dict[str, Any]:
    """Run one case; add its metadata operations per group (JuiceFS only), and the Redis
    commands per group where this run started the volume's server."""
    before, calls = meta_ops(mount), redis_calls(mount)
    res = dict(fn(*args))
    after = meta_ops(mount)
    if calls:
        res["redis_cmds_per_group"] = sum(calls_delta(redis_calls(mount), calls).values()) / args[2]
    if before or after:
        groups = args[2]
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        res["meta_ops_per_group"] = sum(delta.values()) / groups
        res["meta_ops_by_kind"] = {k: round(v / groups, 2) for k, v in sorted(delta.items())
                                   if v}
    return res


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
    report_live_files(q)
    shutil.rmtree(root, ignore_errors=True)
    return rows


#: Directories whose files are work: after the run and a plain gc they hold in-flight work only.
WORK_DIRS = ("pending", "leased", "ready", "batched", "batches", "acked", "dropped", "data",
             "staging", "tmp")


def report_live_files(q: RunQueue) -> dict[str, int]:
    """Files per directory after a plain gc; every group was trained, so work dirs are 0."""
    from strawq.delivery.retention import live_files

    BatchStore(q).gc(sweep=True, compact_drops_at=0)
    q.storage.clean_dead_tmp()
    files = live_files(q.storage)
    beyond = {d: n for d, n in files.items() if d in WORK_DIRS and n}
    print("live files per directory at the end, after gc: "
          + "  ".join(f"{d}={n}" for d, n in sorted(files.items()))
          + ("  (0 beyond in-flight work)" if not beyond else f"  LEFT OVER: {beyond}"))
    return files


def before_w(rows: list[dict[str, float]]) -> int:
    return int(rows[-1]["groups"]) if rows else 0


# -- main ---------------------------------------------------------------------------------------
def engine_of(mount: str) -> str:
    """The metadata engine of the JuiceFS client behind ``mount`` (``unknown`` if unseen)."""
    from strawq.doctor import find_mount, juicefs_settings

    try:
        settings, _argv = juicefs_settings(find_mount(mount).mount_point)
    except OSError:
        return "unknown"
    return {"sqlite3": "sqlite"}.get(settings.meta_engine or "", settings.meta_engine
                                     or "unknown")


def main() -> int:
    global GC_INTERVAL_S
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
    ap.add_argument("--juicefs-redis", default=os.environ.get("STRAWQ_JUICEFS_REDIS_A"),
                    help="a second JuiceFS mount, on Redis metadata, to run on too "
                         "(default $STRAWQ_JUICEFS_REDIS_A)")
    ap.add_argument("--redis-sock", metavar="SOCK",
                    help="the unix socket of the Redis server behind --juicefs-redis: count "
                         "what reached that server too (INFO commandstats, commands per "
                         "group), as --up does for the volume it brings up")
    ap.add_argument("--up", action="store_true",
                    help="bring both JuiceFS test volumes up for this run (SQLite and "
                         "Redis metadata, deploy/juicefs/testvol.sh) instead of using "
                         "--juicefs / --juicefs-redis; on Redis also count the server's "
                         "commands per group")
    ap.add_argument("--gc-interval", type=float, default=GC_INTERVAL_S,
                    help="seconds between the collector's GC passes (the collector's default "
                         "gc_interval_s; before, the bench ran one every 0.05 s)")
    ap.add_argument("--flat-only", action="store_true", help="only the flatness run")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--release-chunk", type=int, default=1, metavar="K",
                    help="strawq releases in chunks of K tasks (queue.release_chunk) and each "
                         "producer claims K tasks per claim, so a claim takes a whole chunk "
                         "by one rename; default 1: one task per claim")
    args = ap.parse_args()
    if args.release_chunk < 1:
        ap.error(f"--release-chunk must be >= 1, got {args.release_chunk}")
    GC_INTERVAL_S = args.gc_interval
    if args.redis_sock is not None:
        if args.up:
            ap.error("--redis-sock names the server of --juicefs-redis; --up counts the "
                     "server it brings up itself")
        if not args.juicefs_redis:
            ap.error("--redis-sock needs --juicefs-redis (or $STRAWQ_JUICEFS_REDIS_A): the "
                     "Redis-backed mount whose server it is")
        if not os.path.isdir(args.juicefs_redis):
            ap.error(f"--juicefs-redis {args.juicefs_redis}: not a directory (is the volume "
                     "mounted?)")
        try:
            commandstats(args.redis_sock)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stdout", None) or getattr(e, "stderr", None) or e
            ap.error(f"--redis-sock {args.redis_sock}: no Redis server answers there "
                     f"({str(detail).strip()})")
        REDIS_SOCKS[args.juicefs_redis] = args.redis_sock
    if not args.up:
        return run_all(args)
    with ExitStack() as stack:
        try:
            sqlite = stack.enter_context(test_volume("sqlite"))
            redis = stack.enter_context(test_volume("redis"))
        except Unavailable as e:
            print(f"queue_ops: --up needs both JuiceFS test volumes: {e}")
            return 2
        assert redis.sock is not None
        args.juicefs, args.juicefs_redis = sqlite.a, redis.a
        REDIS_SOCKS[redis.a] = redis.sock
        return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    producers = [int(x) for x in (args.producers or ("1,4" if args.quick else "1,4,16"))
                 .split(",")]
    groups = args.groups or (64 if args.quick else 512)
    flat = args.flat if args.flat is not None else (2000 if args.quick else 100_000)
    locations: list[tuple[str, str, str | None]] = [
        ("local", tempfile.mkdtemp(prefix="strawq-bench-"), None)]
    for mount in (args.juicefs, args.juicefs_redis):
        if mount and os.path.isdir(mount):
            jd = os.path.join(mount, f"bench-{secrets.token_hex(3)}")
            os.makedirs(jd)
            locations.append((f"jfs-{engine_of(mount)}", jd, mount))
    results: list[dict[str, Any]] = []
    print(f"workload: groups of {args.samples} samples x {args.tokens} tokens "
          f"({args.samples * args.tokens * 17 / 2**10:.0f} KiB of columns), {groups} groups "
          f"per case, fsync on", flush=True)
    hdr = (f"{'fs':<11}{'P':>3} | {'strawq g/s':>11}{'claim p50':>10}{'p99 ms':>8} | "
           f"{'straw g/s':>10}{'claim p50':>10}{'p99 ms':>8} | {'limit g/s':>10} | "
           f"{'÷limit':>7}{'÷straw':>7} | {'meta ops/group q/s/lim':>22}")
    print(hdr)
    print("-" * len(hdr))
    for loc, base, mount in ([] if args.flat_only else locations):
        for p in producers:
            case = (base, p, groups, args.samples, args.tokens)
            a = counted(mount, run_strawq, *case, args.release_chunk)
            b = counted(mount, run_straw, *case)
            c = counted(mount, run_limit, *case)
            ratio = a["groups_s"] / b["groups_s"]
            of_limit = a["groups_s"] / c["groups_s"]
            results.append({"fs": loc, "producers": p, "strawq": a, "straw": b, "limit": c,
                            "ratio": ratio, "of_limit": of_limit})
            ops = " / ".join(f"{x['meta_ops_per_group']:.1f}" for x in (a, b, c)) \
                if "meta_ops_per_group" in a else "-"
            print(f"{loc:<11}{p:>3} | {a['groups_s']:>11.1f}{a['claim_p50_ms']:>10.2f}"
                  f"{a['claim_p99_ms']:>8.2f} | {b['groups_s']:>10.1f}{b['claim_p50_ms']:>10.2f}"
                  f"{b['claim_p99_ms']:>8.2f} | {c['groups_s']:>10.1f} | {of_limit:>7.2f}"
                  f"{ratio:>7.2f} | {ops:>22}", flush=True)
            if "redis_cmds_per_group" in a:
                print(f"{'':<15}Redis commands per group (the server's count) strawq / straw "
                      f"/ limit: " + " / ".join(f"{x['redis_cmds_per_group']:.1f}"
                                                for x in (a, b, c)))
            if "meta_ops_by_kind" in a:
                print(f"{'':<15}strawq meta ops per group by kind: {a['meta_ops_by_kind']}")
                print(f"{'':<15}limit  meta ops per group by kind: {c['meta_ops_by_kind']}")
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
    for _loc, base, _mount in locations:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cases": results, "flat": flat_rows}, f, indent=2)
    def gmean(xs: list[float]) -> float:
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    for loc in dict.fromkeys(r["fs"] for r in results):
        rs = [r for r in results if r["fs"] == loc]
        lops = [r["strawq"]["meta_ops_per_group"] for r in rs
                if "meta_ops_per_group" in r["strawq"]]
        lim = [r["limit"]["meta_ops_per_group"] for r in rs
               if "meta_ops_per_group" in r["limit"]]
        meta = (f", meta ops/group = {sum(lops) / len(lops):.1f} (the limit's: "
                f"{sum(lim) / len(lim):.1f})") if lops and lim else ""
        cmds = [(r["strawq"]["redis_cmds_per_group"], r["limit"]["redis_cmds_per_group"])
                for r in rs if "redis_cmds_per_group" in r["strawq"]]
        if cmds:
            meta += (f", Redis commands/group = {sum(q for q, _ in cmds) / len(cmds):.1f} "
                     f"(the limit's: {sum(x for _, x in cmds) / len(cmds):.1f})")
        print(f"{loc}: strawq/limit = {gmean([r['of_limit'] for r in rs]):.2f}, "
              f"strawq/straw = {gmean([r['ratio'] for r in rs]):.2f}{meta} (geometric means)")
    jfs = [r["strawq"]["meta_ops_per_group"] for r in results
           if "meta_ops_per_group" in r["strawq"]]
    ops = f"{sum(jfs) / len(jfs):.1f}" if jfs else "n/a"
    print(f"queue_ops: strawq/limit = {gmean([r['of_limit'] for r in results]):.2f}, "
          f"strawq/straw = {gmean([r['ratio'] for r in results]):.2f}, "
          f"meta ops/group = {ops}, release_chunk = {args.release_chunk}, chunk leases = "
          f"{int(sum(r['strawq']['chunked'] for r in results))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
