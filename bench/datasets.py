"""Dataset read rate: rows/s through the feeder's reader, for a directory of Parquet shards.

Workload: S shards of R rows each, written once into a temporary directory (local disk):
chat prompts (a system and a user message, ~60 words) with a label and a metadata mapping,
the layout of slime/verl-style RL datasets; Parquet row groups of 1,024 rows. The reader is
the feeder's (``DatasetCursorReader``): rows are read in release-sized chunks (``--chunk``,
the default ``release_batch``), each row validated (prompt kind, chat message shape,
msgpack-serialisable) exactly as a release does. Nothing is written to a queue: this is the
read side only. The same rows as JSONL shards are read for comparison, and a cold open of
the dataset (listing + fingerprint) is timed.

    python bench/datasets.py            # 16 shards x 25,000 rows
    python bench/datasets.py --quick    # 4 shards x 5,000 rows

The last line is ``datasets: parquet shards rows/s = X``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from strawq.data.binding import DatasetCursorReader  # noqa: E402
from strawq.data.dataset import BadRow, Dataset  # noqa: E402

WORDS = ("the a of to and solve find value number sum product prove integer triangle "
         "circle area prime answer step each total how many").split()


def make_rows(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(60))
        out.append({"prompt": [{"role": "system", "content": "Think step by step."},
                               {"role": "user", "content": question}],
                    "label": str(rng.randint(0, 10_000)),
                    "metadata": {"source": "bench", "id": i}})
    return out


def write(root: str, shards: int, rows: int) -> tuple[str, str]:
    pdir, jdir = os.path.join(root, "parquet"), os.path.join(root, "jsonl")
    os.makedirs(pdir)
    os.makedirs(jdir)
    for s in range(shards):
        part = make_rows(rows, s)
        pq.write_table(pa.Table.from_pylist(part),
                       os.path.join(pdir, f"train-{s:05d}-of-{shards:05d}.parquet"),
                       row_group_size=1024)
        with open(os.path.join(jdir, f"train-{s:05d}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return pdir, jdir


def read_all(url: str, chunk: int) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    ds = Dataset(url)
    opened = time.perf_counter() - t0
    reader = DatasetCursorReader(ds)
    n = bad = 0
    t0 = time.perf_counter()
    while True:
        rows = reader.read(n, chunk)
        if not rows:
            break
        n += len(rows)
        bad += sum(isinstance(r, BadRow) for _, r in rows)
    elapsed = time.perf_counter() - t0
    if bad:
        raise SystemExit(f"{bad} bad rows in the bench dataset")
    return n, elapsed, opened


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shards", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None, help="rows per shard")
    ap.add_argument("--chunk", type=int, default=64, help="rows per read (release_batch)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shards = args.shards or (4 if args.quick else 16)
    rows = args.rows or (5_000 if args.quick else 25_000)
    with tempfile.TemporaryDirectory(prefix="strawq-bench-ds-") as root:
        t0 = time.perf_counter()
        pdir, jdir = write(root, shards, rows)
        size = sum(os.path.getsize(os.path.join(pdir, f)) for f in os.listdir(pdir))
        print(f"setup: {shards} shards x {rows} rows of chat prompts, Parquet {size / 1e6:.1f} "
              f"MB, written in {time.perf_counter() - t0:.1f}s; reads of {args.chunk} rows")
        best: dict[str, float] = {}
        for name, url in (("parquet", pdir), ("jsonl", jdir)):
            for _ in range(args.repeats):
                n, elapsed, opened = read_all(url, args.chunk)
                rate = n / elapsed
                best[name] = max(best.get(name, 0.0), rate)
                print(f"{name}: {n} rows in {elapsed:.2f}s = {rate:,.0f} rows/s "
                      f"(open + fingerprint {opened * 1e3:.1f} ms)")
        print(f"best of {args.repeats}: parquet {best['parquet']:,.0f} rows/s, jsonl "
              f"{best['jsonl']:,.0f} rows/s")
        print(f"datasets: parquet shards rows/s = {best['parquet']:.0f}")


if __name__ == "__main__":
    main()
