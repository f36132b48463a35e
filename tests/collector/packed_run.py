"""A run whose collector publishes one batch with resumed samples and extras, for the
packed-shard tests (no torch: the collector side runs it in a process of its own too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from strawq.ondisk.extras import ROUTED_EXPERTS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS, Extra
from strawq.ondisk.groups import GroupData
from strawq.tasks.queue import Lease, RunQueue
from tests.collector.helpers import make_run, write_dataset


def _group(lease: Lease, rng: np.random.Generator, max_len: int, version: int,
           prev: GroupData | None, *, extras: bool, final: bool) -> GroupData:
    """A group of 3 samples: ``prev``'s prefixes (an earlier version's tokens) extended by
    tokens of ``version``; with ``extras``, per-token extras a producer records."""
    g = 3
    prompt = np.asarray(lease.task["row"]["prompt"], np.int32)
    toks, lps, vers = [], [], []
    for i in range(g):
        s = prev.sample(i) if prev is not None else None
        k = int(rng.integers(0, max_len + 1))
        toks.append(np.concatenate([s["tokens"] if s else np.empty(0, np.int32),
                                    rng.integers(0, 1 << 20, k).astype(np.int32)]))
        lps.append(np.concatenate([s["logprobs"] if s else np.empty(0, np.float32),
                                   -rng.random(k, dtype=np.float32)]))
        vers.append(np.concatenate([s["versions"] if s else np.empty(0, np.int64),
                                    np.full(k, version, np.int64)]))
    lens = [t.shape[0] for t in toks]
    n = sum(lens)
    x: dict[str, Extra] = {}
    if extras and final:
        rows = prompt.shape[0] * g + n
        x[ROUTED_EXPERTS] = Extra(rng.integers(0, 8, (rows, 2, 2)).astype(np.int32))
        x[TEACHER_LOGPROBS] = Extra(-rng.random(n, dtype=np.float32))
        counts = rng.integers(0, 3, n).astype(np.int32)
        x[TOP_P_TOKEN_IDS] = Extra(rng.integers(0, 99, int(counts.sum())).astype(np.int32),
                                   counts)
    return GroupData(task_id=lease.task_id, index=int(lease.task["index"]), prompt_ids=prompt,
                     sample_lens=lens, tokens=np.concatenate(toks),
                     logprobs=np.concatenate(lps), versions=np.concatenate(vers),
                     loss_mask=rng.integers(0, 2, n).astype(np.uint8),
                     rewards=[float(r) for r in rng.random(g)] if final else [None] * g,
                     status=["completed" if final else "aborted"] * g,
                     meta={"params": [{"temperature": 0.7, "top_p": 0.9, "top_k": 5}] * g},
                     extras=x)


def packed_run(tmp_path: Path, *, groups: int, max_len: int, pack_ranks: int | None,
         seed: int = 0) -> tuple[RunQueue, Collector]:
    """A run whose collector publishes one batch of ``groups`` groups: half of them resumed
    from prefixes of version 0 and finished at version 1 (some with extras)."""
    q = make_run(str(tmp_path / "run"), group_size=3, release_batch=groups)
    ds = write_dataset(str(tmp_path / "ds.jsonl"), groups, seed=seed)
    col = Collector(q, Dataset(ds), CollectorConfig(
        batch_groups=groups, max_running=groups, max_ready=groups, poll_interval_s=0,
        gc_interval_s=1e9, pack_ranks=pack_ranks))
    col.start(wait=False)
    col.step()
    rng = np.random.default_rng(seed)
    leases = q.claim("p", groups)
    for k, lease in enumerate(leases):
        if k % 2 == 0:
            q.yield_partial(lease, _group(lease, rng, max_len, 0, None, extras=False,
                                          final=False))
        else:
            q.complete(lease, _group(lease, rng, max_len, 0, None, extras=k % 4 == 1,
                                     final=True))
    q.set_version(1)
    for lease in q.claim("p", groups):
        q.complete(lease, _group(lease, rng, max_len, 1, q.load_partial(lease),
                                 extras=k % 3 == 0, final=True))
    rep = col.step()
    assert rep.published == [1]
    return q, col
