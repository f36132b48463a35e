"""Shared pieces of the producer tests: runs with released prompts, and a driver loop."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.ondisk.names import TaskName
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.storage import PosixStorage, Storage
from strawq.tasks.queue import RunQueue
from strawq.testing.waiting import async_wait_until


def config_with(base: dict[str, Any], sections: dict[str, Any]) -> ProducerConfig:
    """``base`` (a producer config as a mapping) with ``sections`` laid over it key by key
    within each section: ``budget={"slots": 1}`` changes the slots and keeps the rest of
    ``base["budget"]``; a value inside a section replaces the base's value whole."""
    data = dict(base)
    for name, value in sections.items():
        data[name] = ({**data.get(name, {}), **value} if isinstance(value, dict) else value)
    return ProducerConfig.from_dict(data)


def make_run(path: str, n: int, *, rows: list[dict[str, Any]] | None = None, seed: int = 0,
             storage: Storage | None = None, **queue_kw: Any) -> RunQueue:
    """A run at ``path`` with ``n`` prompts (token-id lists) released into pending; on
    ``storage`` when given (``path`` then only holds the dataset file)."""
    os.makedirs(path, exist_ok=True)
    kw: dict[str, Any] = {"fsync": False, "lease_timeout_s": 3.0, "heartbeat_interval_s": 0.2,
                          "group_size": 4, "release_batch": max(n, 1)}
    kw.update(queue_kw)
    if storage is None:
        storage = PosixStorage(path, writer_id="setup", fsync=kw["fsync"])
    q = RunQueue.create(storage, QueueConfig(**kw))
    rng = np.random.default_rng(seed)
    if rows is None:
        rows = [{"prompt": [int(x) for x in rng.integers(3, 200, int(rng.integers(2, 6)))],
                 "target": 7, "count": 3} for _ in range(n)]
    data = os.path.join(path, "dataset.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if rows:
        Feeder(q, Dataset(data)).release(len(rows))
    return q


def names(q: RunQueue, state: str) -> list[TaskName]:
    out = []
    keys = q.list_pending() if state == "pending" else [
        f"{state}/{n}" for n in q.storage.list(state)]
    for k in keys:
        t = TaskName.try_parse(k.rsplit("/", 1)[1])
        if t is not None:
            out.append(t)
    return out


def ids(q: RunQueue, state: str) -> list[str]:
    return sorted(t.id for t in names(q, state))


def ready_groups(q: RunQueue) -> dict[str, Any]:
    return {t.id: q.read_group(t.id, t.gen) for t in names(q, "ready")}


async def wait_for(cond: Callable[[], bool], timeout: float, what: str,
                   poll: float = 0.05) -> None:
    await async_wait_until(cond, timeout, what=what, poll_s=poll)


async def run_producers(producers: list[Producer],
                        body: Callable[[], Awaitable[None]]) -> None:
    """Run producers while ``body`` drives the test; stop them (parking groups) after."""
    tasks = [asyncio.create_task(p.run()) for p in producers]
    try:
        await body()
    finally:
        for p in producers:
            p.request_stop()
        done, pending = await asyncio.wait(tasks, timeout=60)
        for t in pending:
            t.cancel()
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]


def batch_all_ready(q: RunQueue, dataset_path: str, n: int) -> Any:
    """The ``n`` ready groups of a run as one batch: a collector publishes it (a few passes),
    the reader reads it."""
    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.collector.trainer.reader import BatchReader

    col = Collector(q, Dataset(dataset_path),
                    CollectorConfig(batch_groups=n, max_running=max(n, 16), max_ready=max(n, 16),
                                    poll_interval_s=0, gc_interval_s=0))
    col.start(wait=False)
    for _ in range(50):
        col.step()
        if col.batches.batch_seqs()[0]:
            break
    reader = BatchReader(q)
    try:
        return reader.next_batch(timeout=30)
    finally:
        reader.close()
