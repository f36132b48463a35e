"""Integrations benchmark: the Megatron path against the reader alone, for one rank.

1. Creates B ready groups with the real queue API (G=8 × ~512 response tokens + 64 prompt
   tokens per sample: the collector benchmark's standard case) and publishes one batch.
2. Times R adjacent pairs (order alternating; same page cache and allocator state):
   * ``reader``: ``BatchReader.load`` of rank 0's shard (of 8): read, verify, decode, pack;
   * ``megatron``: the same load, then ``MegatronBatcher.micro_batches`` — micro-batches
     under a tokens-per-GPU budget, THD ``PackedSeqParams``, next-token aligned tensors.
   Throughput is packed tokens per second; the ratio is megatron ÷ reader (≥ 0.9: the
   adapter is not the bottleneck): the median over the pairs of each pair's ratio (other
   jobs on a shared machine move both members of a pair alike). The two stages of the
   pipeline are also timed apart (reader ÷ (reader + packing), printed before).
3. For information, the adapter alone under other layouts (TP=2 with sequence parallelism
   and a 128 tail multiple; CP=2), which pad and gather instead of slicing.

    python bench/integrations.py [--quick] [--groups B] [--tokens L] [--repeat R] [--dir DIR]

``--quick`` (the CI size): 128 groups of ~128 tokens, 3 pairs; it checks the path, its
ratio is noise.

The last line: ``integrations: megatron packing / reader throughput = X``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.collector import build  # noqa: E402
from strawq.collector.config import CollectorConfig  # noqa: E402
from strawq.collector.core import Collector  # noqa: E402
from strawq.collector.trainer.reader import BatchReader  # noqa: E402
from strawq.data.dataset import Dataset  # noqa: E402
from strawq.delivery.batches import Manifest  # noqa: E402
from strawq.storage import open_storage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402

with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
    warnings.simplefilter("ignore")
    from strawq.collector.integrations.megatron import (  # noqa: E402
        MegatronBatcher,
        ParallelLayout,
    )


def paired(reader: BatchReader, man: Manifest, batcher: MegatronBatcher, repeat: int
           ) -> dict[str, list[float]]:
    """Times of the reader alone and of reader + micro-batches, run as adjacent pairs (the
    order alternating), after a warm-up of each; inside the pipeline the two stages are
    timed apart as well. Other jobs on a shared machine move both members of a pair alike,
    so the pair's ratio is steadier than a ratio of separate medians."""
    out: dict[str, list[float]] = {"reader": [], "pipeline": [], "stage_reader": [],
                                   "stage_adapter": []}

    def pipeline() -> None:
        t0 = time.perf_counter()
        batch = reader.load(man)
        t1 = time.perf_counter()
        batcher.micro_batches(batch)
        t2 = time.perf_counter()
        out["pipeline"].append(t2 - t0)
        out["stage_reader"].append(t1 - t0)
        out["stage_adapter"].append(t2 - t1)

    def alone() -> None:
        t0 = time.perf_counter()
        reader.load(man)
        out["reader"].append(time.perf_counter() - t0)

    alone()
    pipeline()
    for v in out.values():
        v.clear()
    for i in range(repeat):
        for fn in ((alone, pipeline) if i % 2 == 0 else (pipeline, alone)):
            fn()
    return out


def best_and_median(fns: dict[str, Callable[[], object]], repeat: int
                    ) -> dict[str, tuple[float, float]]:
    """(fastest, median) seconds of each function, run alternately after a warm-up each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: 128 groups, 3 pairs")
    ap.add_argument("--groups", type=int, default=None,
                    help="groups in the batch (all ranks; default 1024)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="mean response tokens/sample (default 512)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=None, help="adjacent pairs (default 15)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    args.groups = args.groups or (128 if args.quick else 1024)
    args.tokens = args.tokens or (128 if args.quick else 512)
    args.repeat = args.repeat or (3 if args.quick else 15)
    root = tempfile.mkdtemp(prefix="strawq-bench-int-", dir=args.dir)
    try:
        ds, t_build = build(root, args.groups, 8, args.tokens)
        print(f"setup: {args.groups} ready groups (G=8, ~{args.tokens} response tokens/sample)"
              f" in {t_build:.1f}s")
        q = RunQueue.open(open_storage(os.path.join(root, "run"), writer_id="collector"))
        col = Collector(q, Dataset(ds), CollectorConfig(
            batch_groups=args.groups, max_running=16, max_ready=args.groups,
            max_prefetch_batches=1, gc_interval_s=1e9, metrics_interval_s=1e9))
        col.start(wait=False)
        if col.step().published != [1]:
            raise SystemExit("expected batch 1 to be published")
        man = col.batches.read_manifest(1)
        reader = BatchReader(q, rank=0, world_size=args.ranks)
        batcher = MegatronBatcher(max_tokens_per_gpu=args.max_tokens_per_gpu)
        batch = reader.load(man)
        mbs = batcher.micro_batches(batch)
        t = paired(reader, man, batcher, args.repeat)
        tokens = batch.num_tokens
        print(f"rank 0 of {args.ranks}: {len(batch.groups)} groups, {batch.num_samples} "
              f"samples, {tokens} packed tokens -> {len(mbs)} micro-batches of <= "
              f"{args.max_tokens_per_gpu} tokens (TP=1, CP=1; {args.repeat} adjacent pairs, "
              "warm page cache; median [fastest])")
        for key, what in (("reader", "reader alone"), ("pipeline", "reader + megatron packing"),
                          ("stage_adapter", "  of which megatron packing")):
            med, best = statistics.median(t[key]), min(t[key])
            print(f"{what}: {med * 1e3:.2f} [{best * 1e3:.2f}] ms = "
                  f"{tokens / med / 1e6:.1f} [{tokens / best / 1e6:.1f}] M tokens/s")
        for name, lay in (("TP=2 SP, tail x128", ParallelLayout(
                tp_size=2, sequence_parallel=True, pad_multiple=128)),
                ("CP=2 (rank 0)", ParallelLayout(cp_size=2, cp_rank=0))):
            b = MegatronBatcher(lay, max_tokens_per_gpu=args.max_tokens_per_gpu // lay.cp_size)
            best, med = best_and_median({"a": lambda b=b: b.micro_batches(batch)},
                                        args.repeat)["a"]
            print(f"megatron packing alone, {name}: {best * 1e3:.2f} / {med * 1e3:.2f} ms = "
                  f"{tokens / best / 1e6:.1f} / {tokens / med / 1e6:.1f} M tokens/s")
        reader.close()
        col.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pairs = [r / p for r, p in zip(t["reader"], t["pipeline"], strict=True)]
    stages = [r / (r + a) for r, a in zip(t["stage_reader"], t["stage_adapter"], strict=True)]
    print(f"integrations: within the pipeline, reader / (reader + packing) = "
          f"{statistics.median(stages):.2f} (median of {len(stages)})")
    print(f"integrations: paired ratios {min(pairs):.2f} .. {max(pairs):.2f}")
    print(f"integrations: megatron packing / reader throughput = "
          f"{statistics.median(pairs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
