"""Subprocess roles for the crash tests: ``collector``, ``trainer``, ``producer``.

    python tests/collector/procs.py collector RUN DATASET
    python tests/collector/procs.py trainer RUN OUT [--update-every K]
    python tests/collector/procs.py producer RUN NAME --seed S

The trainer's "training" of batch s is the exclusive create of ``OUT/trained-<s>.json``
(the dataset indices of its groups plus ``reader.state_dict()``: the checkpoint), then the
ack. A trainer restarted after ``kill -9`` loads the newest checkpoint and continues.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BatchTimeout, RunFinished
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import SimProducer

CONFIG = {"batch_groups": 4, "max_running": 8, "max_ready": 8, "max_prefetch_batches": 2,
          "max_staleness": 3, "eta_mode": "drop", "poll_interval_s": 0.01,
          "gc_interval_s": 0.2, "takeover_timeout_s": 0.6}


def latest_checkpoint(out: str) -> dict | None:
    seqs = sorted(int(n[8:-5]) for n in os.listdir(out) if n.startswith("trained-"))
    if not seqs:
        return None
    with open(os.path.join(out, f"trained-{seqs[-1]}.json"), encoding="utf-8") as f:
        state: dict = json.load(f)["state"]
    return state


def run_collector(args: argparse.Namespace) -> int:
    col = Collector.open(args.run, Dataset(args.dataset), CollectorConfig(**CONFIG),
                         fsync=False, owner=f"col{os.getpid()}")
    col.run(until_drained=True)
    col.close()
    return 0


def run_trainer(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    reader = BatchReader.open(args.run)
    ckpt = latest_checkpoint(args.out)
    if ckpt is not None:
        reader.load_state_dict(ckpt)
    if reader.bracket.is_open:  # a previous trainer died inside the bracket: finish it
        reader.bracket.weight_update(lambda v: None, timeout=30)
    while not os.path.exists(os.path.join(args.out, "stop")):
        try:
            batch = reader.next_batch(timeout=0.5)
        except BatchTimeout:
            continue
        except RunFinished:  # commit the last checkpoint (the collector waits for it), stop
            if latest_checkpoint(args.out) is not None:
                reader.commit(latest_checkpoint(args.out))
            return 0
        body = {"seq": batch.seq, "indices": [s["index"] for s in batch.summaries],
                "skipped": batch.skipped, "state": reader.state_dict(consumed=batch)}
        tmp = os.path.join(args.out, f".tmp-{batch.seq}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f)
        os.link(tmp, os.path.join(args.out, f"trained-{batch.seq}.json"))  # exclusive
        os.unlink(tmp)
        reader.ack(batch)
        if args.update_every and batch.seq % args.update_every == 0:
            reader.bracket.weight_update(lambda v: None, timeout=30)
    return 0


def run_producer(args: argparse.Namespace) -> int:
    queue = RunQueue.open(open_storage(args.run, writer_id=args.name, fsync=False))
    p = SimProducer(queue, args.name, seed=args.seed, slots=3)
    while not os.path.exists(os.path.join(args.run, "..", "stop-producers")):
        p.step()
        time.sleep(0.005)
    p.yield_all()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s: %(message)s")
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("collector")
    s.add_argument("run")
    s.add_argument("dataset")
    s = sub.add_parser("trainer")
    s.add_argument("run")
    s.add_argument("out")
    s.add_argument("--update-every", type=int, default=0)
    s = sub.add_parser("producer")
    s.add_argument("run")
    s.add_argument("name")
    s.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    return {"collector": run_collector, "trainer": run_trainer,
            "producer": run_producer}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
