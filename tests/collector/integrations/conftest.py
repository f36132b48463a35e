"""Shared builders for the integration adapters' tests: reader ``Batch`` objects laid out
exactly as ``BatchReader.load`` lays them out (prompt then response per sample)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from strawq.collector.trainer.reader import Batch
from strawq.ondisk.names import TaskName

#: why the slime tests skip where slime is missing, and how to install it
SLIME_MISSING = ("slime not installed: make slime SLIME_SRC=pinned (docs/slime.md, Install)")


def make_batch(prompt_lens: Sequence[int], resp_lens: Sequence[int], *, group_size: int = 1,
               seed: int = 0, seq: int = 1) -> Batch:
    """A Batch of S samples; sample i has ``prompt_lens[i]`` + ``resp_lens[i]`` tokens.

    Values are distinct per position so misalignment shows: token ids 1000 + position,
    log-probs −position/1e6, versions 10 + sample index, advantages = sample index.
    """
    rng = np.random.default_rng(seed)
    p = np.asarray(prompt_lens, dtype=np.int64)
    r = np.asarray(resp_lens, dtype=np.int64)
    n = p.shape[0]
    lens = p + r
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    tokens = (1000 + np.arange(total)).astype(np.int32)
    resp = np.zeros(total, dtype=bool)
    for i in range(n):
        resp[cu[i] + p[i]:cu[i + 1]] = True
    mask = (resp & (rng.random(total) < 0.9)).astype(np.uint8)
    lps = np.where(resp, -np.arange(total) / 1e6, 0.0).astype(np.float32)
    sample_of = np.repeat(np.arange(n), lens)
    vers = np.where(resp, 10 + sample_of, -1).astype(np.int64)
    sadv = np.arange(n, dtype=np.float32)
    ngroups = -(-n // group_size)
    groups = [TaskName(key=f"{0:012d}.{g:012d}", id=f"i{g:012d}", gen=0, attempts=1)
              for g in range(ngroups)]
    summaries = []
    for g in range(ngroups):
        idx = list(range(g * group_size, min((g + 1) * group_size, n)))
        summaries.append({"task_id": groups[g].id, "index": g,
                          "sample_lens": [int(r[i]) for i in idx],
                          "prompt_len": int(p[idx[0]]), "rewards": [float(i % 2) for i in idx],
                          "status": ["completed"] * len(idx), "advantages": [float(i) for i in idx],
                          "min_version": 10 + idx[0], "max_version": 10 + idx[-1]})
    return Batch(
        seq=seq, rank=0, world_size=1, version=12, tokens=torch.from_numpy(tokens),
        cu_seqlens=torch.from_numpy(cu), loss_mask=torch.from_numpy(mask),
        rollout_logprobs=torch.from_numpy(lps), versions=torch.from_numpy(vers),
        advantages=torch.from_numpy(np.repeat(sadv, lens)),
        rewards=torch.from_numpy((np.arange(n) % 2).astype(np.float32)),
        sample_advantages=torch.from_numpy(sadv),
        prompt_lens=torch.from_numpy(p.astype(np.int32)),
        response_lens=torch.from_numpy(r.astype(np.int32)),
        sample_group=torch.from_numpy(np.arange(n, dtype=np.int64) // group_size),
        sample_index=torch.from_numpy(np.arange(n, dtype=np.int64) // group_size),
        sample_min_version=torch.from_numpy(10 + np.arange(n, dtype=np.int64)),
        groups=groups, summaries=summaries, total_groups=ngroups)


@pytest.fixture
def batch_factory():
    return make_batch
