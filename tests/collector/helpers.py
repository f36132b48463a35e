"""Test producers and fixtures that use ``RunQueue`` directly (no Ray, no engines).

``SimProducer`` follows the producer contract of the weight-update bracket
(``docs/collector.md``): heartbeat every step; while ``Control`` shows a pause it has not
acknowledged, stop claiming, yield every held group as a partial (or complete it if every
sample is done), then ack; while paused, claim nothing; after the resume read
``current_version()`` and go on. Generation is a few tokens per sample per ``step()``, so
groups span steps and weight versions.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from strawq.config import QueueConfig
from strawq.errors import LeaseLost
from strawq.ondisk.groups import GroupData
from strawq.storage import open_storage
from strawq.tasks.queue import Lease, RunQueue
from strawq.weights.control import Control


def write_dataset(path: str, n: int, *, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            plen = int(rng.integers(2, 6))
            f.write(json.dumps({"prompt": [int(x) for x in rng.integers(1, 100, plen)],
                                "i": i}) + "\n")
    return path


def make_run(path: str, **queue_kw: Any) -> RunQueue:
    os.makedirs(path, exist_ok=True)
    kw: dict[str, Any] = {"fsync": False, "lease_timeout_s": 2.0,
                          "heartbeat_interval_s": 0.2, "group_size": 4, "release_batch": 8}
    kw.update(queue_kw)
    return RunQueue.create(open_storage(path, writer_id="setup", fsync=kw["fsync"]),
                           QueueConfig(**kw))


@dataclass
class _Work:
    lease: Lease
    prompt: np.ndarray
    targets: list[int]
    toks: list[list[int]] = field(default_factory=list)
    lps: list[list[float]] = field(default_factory=list)
    vers: list[list[int]] = field(default_factory=list)

    def done(self, i: int) -> bool:
        return len(self.toks[i]) >= self.targets[i]


class SimProducer:
    """A producer that generates fake tokens in chunks (deterministic per seed)."""

    def __init__(self, queue: RunQueue, name: str, *, slots: int = 4, group_size: int = 4,
                 chunk: int = 3, max_new: tuple[int, int] = (1, 10), seed: int = 0,
                 zero_variance_drop: bool = False) -> None:
        self.queue = queue
        self.name = name
        self.control = Control(queue.storage)
        self.slots = slots
        self.G = group_size
        self.chunk = chunk
        self.max_new = max_new
        self.rng = np.random.default_rng(seed)
        self.work: list[_Work] = []
        self.acked: set[int] = set()
        self.zero_variance_drop = zero_variance_drop
        self.completed: list[str] = []
        self.partials = 0

    def _start(self, lease: Lease) -> _Work:
        prompt = np.asarray(lease.task["row"]["prompt"], dtype=np.int32)
        w = _Work(lease, prompt, [int(self.rng.integers(*self.max_new)) for _ in range(self.G)])
        prev = self.queue.load_partial(lease)
        for i in range(self.G):
            if prev is not None:
                s = prev.sample(i)
                w.toks.append(s["tokens"].tolist())
                w.lps.append(s["logprobs"].tolist())
                w.vers.append(s["versions"].tolist())
                w.targets[i] = int(prev.meta["targets"][i])
            else:
                w.toks.append([])
                w.lps.append([])
                w.vers.append([])
        return w

    def _group(self, w: _Work, final: bool) -> GroupData:
        toks = [t for s in w.toks for t in s]
        status = ["completed" if (final or w.done(i)) else "aborted" for i in range(self.G)]
        rewards: list[float | None] = [
            float(sum(s) % 7) / 7.0 if final else None for s in w.toks]
        return GroupData(task_id=w.lease.task_id, index=int(w.lease.task["index"]),
                         prompt_ids=w.prompt, sample_lens=[len(s) for s in w.toks],
                         tokens=np.asarray(toks, dtype=np.int32),
                         logprobs=np.asarray([x for s in w.lps for x in s], dtype=np.float32),
                         versions=np.asarray([x for s in w.vers for x in s], dtype=np.int64),
                         loss_mask=np.ones(len(toks), dtype=np.uint8), rewards=rewards,
                         status=status, meta={"targets": w.targets, "producer": self.name})

    def step(self) -> None:
        self.queue.heartbeat(self.name)
        st = self.control.state()
        if st.paused:
            if st.pause_version not in self.acked:
                n = self.yield_all()
                self.control.ack(st.pause_version, self.name, partials=n)
                self.acked.add(st.pause_version)
            return
        free = self.slots - len(self.work)
        if free > 0:
            for lease in self.queue.claim(self.name, free):
                self.work.append(self._start(lease))
        version = self.queue.current_version()
        keep = []
        for w in self.work:
            for i in range(self.G):
                k = min(self.chunk, w.targets[i] - len(w.toks[i]))
                if k > 0:
                    w.toks[i] += [int(x) for x in self.rng.integers(100, 200, k)]
                    w.lps[i] += [float(x) for x in -self.rng.random(k)]
                    w.vers[i] += [version] * k
            if all(w.done(i) for i in range(self.G)):
                self._finish(w)
            else:
                keep.append(w)
        self.work = keep

    def _finish(self, w: _Work) -> None:
        g = self._group(w, final=True)
        try:
            if self.zero_variance_drop and len(set(g.rewards)) == 1:
                self.queue.drop(w.lease, "zero_variance", "all rewards equal",
                                summary=g.summary())
            else:
                self.queue.complete(w.lease, g)
                self.completed.append(w.lease.task_id)
        except LeaseLost:
            pass

    def yield_all(self) -> int:
        """Persist every held group (partial, or complete if finished); returns partials."""
        n = 0
        for w in self.work:
            try:
                if all(w.done(i) for i in range(self.G)):
                    self._finish(w)
                elif any(w.toks):
                    self.queue.yield_partial(w.lease, self._group(w, final=False))
                    n += 1
                else:
                    self.queue.release(w.lease)
            except LeaseLost:
                pass
        self.work = []
        self.partials += n
        return n


class FakeClock:
    """A monotonic clock the test moves; ``sleep`` advances it and runs a hook."""

    def __init__(self, hook: Any = None) -> None:
        self.t = 1000.0
        self.hook = hook

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += max(dt, 1e-3)
        if self.hook is not None:
            self.hook()


def train_until_drained(collector: Any, producer: SimProducer, reader: Any,
                        on_batch: Any, *, passes: int = 3000) -> bool:
    """One producer, the collector and a trainer's reader, pass by pass: every published
    batch is read and handed to ``on_batch(batch)`` before its ack. True once the run has
    drained; False as soon as ``on_batch`` returns True (stop there, the batch acked);
    AssertionError if neither happens within ``passes``."""
    for _ in range(passes):
        producer.step()
        rep = collector.step()
        seqs, acked = collector.batches.batch_seqs()
        if any(s not in acked for s in seqs):
            b = reader.next_batch(timeout=5)
            stop = on_batch(b)
            reader.ack(b)
            if stop:
                return False
        if rep.drained:
            return True
    raise AssertionError("the run did not drain")


def drive(collector: Any, producers: list[SimProducer], steps: int) -> None:
    for _ in range(steps):
        collector.step()
        for p in producers:
            p.step()


#: the shipped examples (deploy/examples), loaded by their file as a user runs them
EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def load_example(name: str) -> ModuleType:
    """``deploy/examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
