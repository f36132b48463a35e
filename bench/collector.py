"""Collector benchmark: batch selection + publish, and the reader's load throughput.

1. Creates N ready groups with the real queue API on a temporary directory (release by the
   Feeder, claim, complete; G samples of ~L response tokens each).
2. Times one collector pass that selects B groups staleness-first out of the N ready and
   publishes the manifest (summaries read from record headers, advantages computed, fsync'd
   manifest: the batch's commit, its groups left in ready/), with ``pack_ranks`` = the
   reader's world size: the pass also reads the batch's records and writes one packed shard
   per rank (``strawq.delivery.packed``); what that costs (seconds, bytes read and written)
   is printed.
3. Times ``BatchReader.load`` for rank 0 of 8 on both paths against ``numpy.fromfile`` of
   the bytes each path reads: from its packed shard (one read into a reused buffer, xxh3,
   views) against ``numpy.fromfile`` of the shard file, and from the group records (read,
   xxh3 verify, Arrow decode, packing into torch tensors) against ``numpy.fromfile`` of the
   same record files. Everything reads warm: the page cache cannot be dropped here, so each
   is run once to warm up, then the four are timed alternately (same page cache and
   allocator state) and the medians of R are compared.

Two cases: the standard one (G=8 x ~512 response tokens, ~70 KB records; ``--tokens``) and
the queue benchmark's groups (G=8 x ~2,048 tokens, ~280 KB records; ``--big-tokens``, built
with just one batch of ready groups), run first.

    python bench/collector.py [--quick] [--dir DIR] [--threads N]

Each case prints ``collector: reader/raw read = R`` (the packed shard path; the records
path's ratio beside it). The standard case then batches every group left (unacked: the
backlog a checkpointing trainer leaves until its next commit, the groups left in
``ready/``) and times what a collector pass lists then, against ``os.listdir`` of the task
directories: ``collector: a pass's listings with N groups in unacked batches``. The last
line is the standard case's,
``collector: reader GB/s ratio vs raw read = X``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.packing import allocate_buffer, group_tokens, shard_groups
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery import packed
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import data_key
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import depths, upstream_depths


def build(root: str, n: int, g: int, length: int, seed: int = 0) -> tuple[str, float]:
    rng = np.random.default_rng(seed)
    ds = os.path.join(root, "ds.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": [int(x) for x in rng.integers(1, 50000, 64)]})
                     + "\n" for _ in range(n))
    run = os.path.join(root, "run")
    os.makedirs(run)
    q = RunQueue.create(open_storage(run, writer_id="setup", fsync=False),
                        QueueConfig(fsync=False, release_batch=1024, group_size=g))
    feeder = Feeder(q, Dataset(ds))
    t0 = time.perf_counter()
    while not feeder.exhausted:
        feeder.release(1024)
    done = 0
    while done < n:
        for lease in q.claim("bench", 256):
            lens = rng.integers(length // 2, length * 3 // 2, g)
            total = int(lens.sum())
            v = int(rng.integers(0, 4))
            grp = GroupData(task_id=lease.task_id, index=int(lease.task["index"]),
                            prompt_ids=np.asarray(lease.task["row"]["prompt"], np.int32),
                            sample_lens=lens.tolist(),
                            tokens=rng.integers(0, 50000, total, dtype=np.int32),
                            logprobs=-rng.random(total, dtype=np.float32),
                            versions=np.full(total, v, np.int64),
                            loss_mask=np.ones(total, np.uint8),
                            rewards=rng.random(g).tolist(), status=["completed"] * g)
            q.complete(lease, grp)
            done += 1
    return ds, time.perf_counter() - t0


def alternate(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each function, run alternately (same page cache and allocator
    state for all), after one warm-up call each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    keep: dict[str, object] = {}
    for k, fn in fns.items():
        keep[k] = fn()  # warm-up: page cache, allocator, Arrow schema cache
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            keep[k] = fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_case(root: str, *, n: int, g: int, length: int, batch: int, ranks: int, repeat: int,
             threads: int, publish_line: bool) -> tuple[float, float]:
    """Build a run, publish batch 1 with its rank shards, compare both reader paths with
    numpy.fromfile of what each reads; (packed shard ratio, records ratio)."""
    ds, t_build = build(root, n, g, length)
    print(f"setup: {n} ready groups (G={g}, ~{length} response tokens/sample) in "
          f"{t_build:.1f}s")
    run = os.path.join(root, "run")
    q = RunQueue.open(open_storage(run, writer_id="collector", fsync=True))
    col = Collector(q, Dataset(ds), CollectorConfig(
        batch_groups=batch, max_running=16, max_ready=max(n, batch),
        max_prefetch_batches=1, gc_interval_s=1e9, metrics_interval_s=1e9,
        pack_ranks=ranks))
    col.start(wait=False)
    t0 = time.perf_counter()
    rep = col.step()
    t_step = time.perf_counter() - t0
    if rep.published != [1] or len(rep.packed) != 1:
        raise SystemExit(f"expected batch 1 to be published and packed, got {rep.published}")
    pk = rep.packed[0]
    if publish_line:
        t0 = time.perf_counter()
        ordered = col.order.order(col.batches.scan_ready())
        t_scan = time.perf_counter() - t0
        print(f"collector: select + publish {batch} of {n} ready groups: "
              f"{(t_step - pk.seconds) * 1e3:.1f} ms per pass (fsync on; a later scan+order "
              f"of the {len(ordered)} left: {t_scan * 1e3:.1f} ms)")
    print(f"collector: packing {ranks} rank shards (pack_ranks={ranks}): "
          f"{pk.seconds * 1e3:.1f} ms per batch, {pk.bytes_read / 1e6:.1f} MB of records "
          f"read, {pk.bytes_written / 1e6:.1f} MB of shards written (fsync on; "
          f"{pk.bytes_written / max(pk.bytes_read, 1):.2f}x the records)")
    # one reader per path, as a trainer runs one: each holds its last batch while it loads
    # the next, so its two pool buffers are reused (one reader alternating both paths would
    # hold three batches and allocate fresh pages for every load)
    reader = BatchReader(q, rank=0, world_size=ranks, read_threads=threads)
    shard_reader = BatchReader(q, rank=0, world_size=ranks, read_threads=threads)
    unverified = BatchReader(q, rank=0, world_size=ranks, verify=False)  # the xxh3's share
    man = col.batches.read_manifest(1)
    records = dataclasses.replace(man, meta={k: v for k, v in man.meta.items()
                                             if k != "packed"})
    mine = shard_groups([group_tokens(s) for s in man.summaries], ranks)[0]
    paths = [q.storage.local_path(data_key(man.groups[i].id, man.groups[i].gen, "group"))
             for i in mine]
    shard = q.storage.local_path(packed.shard_key(1, man.meta["packed"]["tag"], ranks, 0))
    assert shard is not None
    nbytes = sum(os.path.getsize(p) for p in paths)
    sbytes = os.path.getsize(shard)
    # the bare read at its best: one preadv into a reused buffer on huge pages, as the pool's
    reuse = allocate_buffer(max(sbytes, max(os.path.getsize(p) for p in paths)))
    t = alternate({"raw": lambda: [np.fromfile(p, dtype=np.uint8) for p in paths],
                   "load": lambda: reader.load(records),
                   "raw_shard": lambda: np.fromfile(shard, dtype=np.uint8),
                   "pread_shard": lambda: pread_into([shard], reuse),
                   "load_shard": lambda: shard_reader.load(man),
                   "load_shard_nv": lambda: unverified.load(man)}, repeat)
    b_rec, b_shard = reader.load(records), shard_reader.load(man)
    reader.close()
    shard_reader.close()
    unverified.close()
    if not b_shard.packed or b_rec.packed or not torch_equal(b_rec, b_shard):
        raise SystemExit("the packed shard's batch differs from the records' batch")
    ratio_rec = t["raw"] / t["load"]
    ratio_shard = t["raw_shard"] / t["load_shard"]
    print(f"reader: rank 0 of {ranks}: {len(mine)} groups, {b_shard.num_tokens} packed tokens "
          f"(warm page cache, {threads} read thread(s), median of {repeat}, alternating)")
    print(f"reader: packed shard: 1 file, {sbytes / 1e6:.1f} MB: load into torch "
          f"{t['load_shard'] * 1e3:.2f} ms = {sbytes / t['load_shard'] / 1e9:.2f} GB/s; "
          f"numpy.fromfile {t['raw_shard'] * 1e3:.2f} ms = "
          f"{sbytes / t['raw_shard'] / 1e9:.2f} GB/s; ratio {ratio_shard:.2f} (against "
          f"os.preadv into a reused buffer, {t['pread_shard'] * 1e3:.2f} ms: "
          f"{t['pread_shard'] / t['load_shard']:.2f}; without the xxh3 check "
          f"{t['load_shard_nv'] * 1e3:.2f} ms)")
    print(f"reader: records: {len(paths)} files, {nbytes / 1e6:.1f} MB "
          f"({nbytes / len(paths) / 1e3:.0f} KB/record): load into torch "
          f"{t['load'] * 1e3:.2f} ms = {nbytes / t['load'] / 1e9:.2f} GB/s; "
          f"numpy.fromfile {t['raw'] * 1e3:.2f} ms = {nbytes / t['raw'] / 1e9:.2f} GB/s; "
          f"ratio {ratio_rec:.2f}")
    print(f"reader: the packed shard loads {t['load'] / t['load_shard']:.1f}x faster than "
          f"the records ({sbytes / nbytes:.2f}x their bytes)")
    print(f"collector: reader/raw read = {ratio_shard:.2f} (packed shard; from the records "
          f"{ratio_rec:.2f}), G={g} x ~{length} tokens, {nbytes / len(paths) / 1e3:.0f} KB "
          "records")
    if publish_line:
        pass_listings(col, run, batch, repeat)
    return ratio_shard, ratio_rec


def pass_listings(col: Collector, run: str, batch: int, repeat: int) -> None:
    """What a collector pass lists, with every ready group in an unacked batch: the backlog
    a checkpointing trainer leaves until its next commit (a batch leaves its groups in
    ``ready/``; the pass skips them unparsed). The upstream depths, the ready scan and the
    depths, as ``Collector.step`` runs them, against ``os.listdir`` of the task
    directories, the anchor."""
    store = col.batches
    names = store.scan_ready()
    seq = store.next_seq()
    for i in range(0, len(names), batch):
        store.publish_batch(seq, names[i:i + batch])
        seq += 1
    st = col.storage

    def one_pass() -> int:
        upstream = upstream_depths(st)
        ready = store.scan_ready()
        return depths(st, upstream=upstream, ready=len(ready),
                      batched=store.batched_in_ready).batched

    def listdirs() -> int:
        return sum(len(os.listdir(os.path.join(run, d)))
                   for d in ("pending", "leased", "ready", "batched"))

    t = alternate({"pass": one_pass, "listdir": listdirs}, repeat)
    backlog = one_pass()
    print(f"collector: a pass's listings with {backlog} groups in unacked batches: "
          f"{t['pass'] * 1e3:.1f} ms (os.listdir of the task directories "
          f"{t['listdir'] * 1e3:.1f} ms; ratio {t['pass'] / t['listdir']:.1f})")


def pread_into(paths: list[str], buf: np.ndarray) -> int:
    """The bare read at its best: each file with one ``preadv`` into one reused buffer."""
    n = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            n += os.preadv(fd, [buf[:os.fstat(fd).st_size].data], 0)
        finally:
            os.close(fd)
    return n


def torch_equal(a: object, b: object) -> bool:
    """Two batches hold the same tensors (the bench's own check of the packed path)."""
    import torch

    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) and not (x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2,000 ready groups, 256 tokens")
    ap.add_argument("--dir", default=None, help="where to create the runs (default: temp dirs)")
    ap.add_argument("--ready", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=None, help="mean response tokens/sample")
    ap.add_argument("--big-tokens", type=int, default=2048,
                    help="second case: mean response tokens/sample (0 skips it)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="BatchReader read_threads")
    args = ap.parse_args()
    n = args.ready or (2000 if args.quick else 10000)
    length = args.tokens or (256 if args.quick else 512)
    g = 8
    common = {"g": g, "batch": args.batch, "ranks": args.ranks, "repeat": args.repeat,
              "threads": args.threads}
    ratio_big = None
    if args.big_tokens:  # the queue benchmark's group size (bench/queue_ops.py)
        root = tempfile.mkdtemp(prefix="strawq-bench-", dir=args.dir)
        try:
            print(f"-- case 2: G={g} x ~{args.big_tokens} tokens (the queue benchmark's groups)")
            ratio_big, _ = run_case(root, n=args.batch, length=args.big_tokens,
                                    publish_line=False, **common)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    root = tempfile.mkdtemp(prefix="strawq-bench-", dir=args.dir)
    try:
        print(f"-- case 1 (standard): G={g} x ~{length} tokens")
        ratio, _ = run_case(root, n=n, length=length, publish_line=True, **common)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if ratio_big is not None:
        print(f"collector: reader GB/s ratio vs raw read, G={g} x {args.big_tokens} tokens = "
              f"{ratio_big:.2f}")
    print(f"collector: reader GB/s ratio vs raw read = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
