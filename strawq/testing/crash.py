"""Crash testing: die for real (``SIGKILL``) at a chosen storage operation, then recover.

* ``KillAt(inner, n)`` — a storage wrapper that sends its own process ``SIGKILL`` right
  before the ``n``-th mutating operation (publish, rename, delete, rmdir): the store keeps
  exactly what a ``kill -9`` there leaves.
* ``KillInsidePublish(root, n)`` — a ``PosixStorage`` that dies *inside* the ``n``-th
  ``publish``: the temporary file is written, fsync'd and closed, the rename has not
  happened; an ``in_place`` publish (a record in a private staging directory) dies with
  half its bytes written at its key. It hooks ``PosixStorage._rename_noreplace`` (called by
  ``publish`` with a source under ``tmp/``) and ``PosixStorage._fill``, so the library
  itself needs no test hook.
* ``recover(storage, dataset)`` — what a restarted collector does: finish or discard the
  feeder's release, finish batch commits, expire the dead holders' leases (on an injected
  clock), remove the dead writers' temporary files.
* ``drain(storage, dataset)`` — run the queue to the end (release, claim, resume, complete,
  batch, ack, gc) so a test can check that nothing was lost or trained twice.
* ``python -m strawq.testing.crash ROOT DATASET LOG --kill-at N [--inside-publish]`` — the
  worker that tests run as a subprocess: one producer-and-feeder sequence touching every
  operation, killed at step ``N`` (``--kill-at 0``: never). It appends facts it has made
  durable (batches it published and acked) to ``LOG``, one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery.batches import BatchStore
from strawq.storage import PosixStorage, Storage
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.testing.factories import make_group, make_partial
from strawq.testing.faults import FaultyStorage

_MUTATING = ("publish", "rename", "delete", "rmdir")


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(FaultyStorage):
    """``SIGKILL`` this process right before the ``n``-th mutating operation."""

    def __init__(self, inner: Storage, n: int) -> None:
        super().__init__(inner)
        self.kill_at = n

    def _enter(self, op: str, *keys: str) -> None:
        if op in _MUTATING and self.kill_at and self.mutations + 1 >= self.kill_at:
            _die()
        super()._enter(op, *keys)


class KillInsidePublish(PosixStorage):
    """``SIGKILL`` inside the ``n``-th publish: temporary file complete, not yet renamed; or,
    for an ``in_place`` publish, half its bytes written at its key."""

    def __init__(self, root: str, n: int, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.kill_at = n
        self.publishes = 0
        self._tmp_root = "tmp/"  # keys under it: temporary files

    def _due(self) -> bool:
        self.publishes += 1
        return bool(self.kill_at) and self.publishes >= self.kill_at

    def _rename_noreplace(self, at: Any, src: str, dst: str) -> None:
        if src.startswith(self._tmp_root) and self._due():
            _die()
        super()._rename_noreplace(at, src, dst)

    def _fill(self, fd: int, key: str, chunks: Sequence[bytes | bytearray | memoryview],
              sync: bool) -> None:
        if not key.startswith(self._tmp_root) and self._due():
            blob = b"".join(bytes(c) for c in chunks)
            os.write(fd, blob[:len(blob) // 2])
            os.fsync(fd)
            _die()
        super()._fill(fd, key, chunks, sync)


# -- recovery and drain (the parent's side) --------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def recover(storage: Storage, dataset: Dataset, *, dead_writers: Iterable[str] = ()
            ) -> RunQueue:
    """Restart the collector's side after a crash and expire every lease of the dead.

    Every producer is assumed dead: all current leases expire (on an injected clock, so no
    test waits for a real timeout).
    """
    q = RunQueue.open(storage)
    Feeder(q, dataset)
    BatchStore(q).recover()
    clock = _Clock()
    mon = LeaseMonitor(q, clock=clock)
    mon.scan()
    clock.t += q.config.lease_timeout_s + 1
    mon.scan()
    inner = storage.inner if isinstance(storage, FaultyStorage) else storage
    if isinstance(inner, PosixStorage):
        for w in dead_writers:
            inner.clean_tmp(w)
    return q


def drain(storage: Storage, dataset: Dataset, *, producer: str = "drainer",
          max_rounds: int = 1000) -> dict[int, list[str]]:
    """Run the queue to completion; returns {batch seq: task ids} of the batches it trained.

    Unacked batches found by recovery are acked first (the trainer consumes them again).
    Every claimed task is completed; a task with a saved prefix resumes from it.
    """
    q = RunQueue.open(storage)
    feeder = Feeder(q, dataset)
    bs = BatchStore(q)
    trained: dict[int, list[str]] = {}
    for man in bs.recover():
        trained[man.seq] = [n.id for n in man.groups]
        bs.ack(man.seq)
    for _ in range(max_rounds):
        feeder.release()
        leases = q.claim(producer, 8)
        for lease in leases:
            prefix = q.load_partial(lease)
            group = make_group(lease.task_id, int(lease.task["index"]), prefix=prefix)
            q.complete(lease, group)
        ready = bs.scan_ready()
        if ready:
            seq = bs.next_seq()
            bs.publish_batch(seq, ready)
            trained[seq] = [n.id for n in ready]
            bs.ack(seq)
            bs.gc()
        if not leases and not ready and feeder.exhausted and not q.list_pending():
            return trained
    raise RuntimeError(f"drain did not finish in {max_rounds} rounds")


# -- the worker (child process side) ---------------------------------------------------------

def _log(path: str, fact: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(fact) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_sequence(storage: Storage, dataset: Dataset, log_path: str,
                 producer: str = "victim") -> None:
    """One producer's and feeder's life, touching every operation once or more."""
    q = RunQueue.open(storage)
    feeder = Feeder(q, dataset)
    bs = BatchStore(q)
    feeder.release(4)
    q.heartbeat(producer)
    a, b, c = q.claim(producer, 3)
    q.complete(a, make_group(a.task_id, int(a.task["index"]), version=1))
    q.yield_partial(b, make_partial(b.task_id, int(b.task["index"]), version=1))
    q.release(c)
    q.heartbeat(producer)
    (resumed,) = q.claim(producer, 1)  # the partial comes first
    prefix = q.load_partial(resumed)
    q.complete(resumed, make_group(resumed.task_id, int(resumed.task["index"]), version=2,
                                   prefix=prefix))
    d, e = q.claim(producer, 2)
    q.fail(d, "engine_error", "injected")
    q.drop(e, "filtered", "zero reward variance")
    feeder.release(4)
    ready = bs.scan_ready()
    seq = bs.next_seq()
    bs.publish_batch(seq, ready)
    _log(log_path, {"batch": seq, "ids": [n.id for n in ready]})
    bs.ack(seq)
    _log(log_path, {"acked": seq})
    bs.gc(full=True)
    (f,) = q.claim(producer, 1)
    q.complete(f, make_group(f.task_id, int(f.task["index"])))


def read_log(path: str) -> tuple[dict[int, list[str]], set[int]]:
    """(batches the worker published, the ones it acked), from its fact log."""
    batches: dict[int, list[str]] = {}
    acked: set[int] = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                fact = json.loads(line)
                if "batch" in fact:
                    batches[int(fact["batch"])] = list(fact["ids"])
                elif "acked" in fact:
                    acked.add(int(fact["acked"]))
    return batches, acked


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strawq.testing.crash")
    p.add_argument("root")
    p.add_argument("dataset")
    p.add_argument("log")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--inside-publish", action="store_true")
    p.add_argument("--writer", default="victim")
    args = p.parse_args(argv)
    storage: Storage
    if args.inside_publish:
        storage = KillInsidePublish(args.root, args.kill_at, writer_id=args.writer)
    else:
        storage = KillAt(PosixStorage(args.root, writer_id=args.writer), args.kill_at)
    run_sequence(storage, Dataset(args.dataset), args.log)
    print("COMPLETED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
