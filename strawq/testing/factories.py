"""Small builders for tests: datasets on disk and group records."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from strawq.ondisk.groups import GroupData


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Any]) -> str:
    """Write one JSON value (or a raw ``str`` line, for malformed rows) per line."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return os.fspath(path)


def prompts(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": f"prompt number {i}", "answer": str(i)} for i in range(start, start + n)]


def make_group(task_id: str, index: int = 0, *, lens: Sequence[int] = (3, 2),
               version: int | Sequence[int] = 0, status: Sequence[str] | None = None,
               marker: float = 0.0, prefix: GroupData | None = None,
               seed: int | None = None) -> GroupData:
    """A group of ``len(lens)`` samples with ``lens[i]`` new tokens each.

    With ``prefix`` (a loaded partial) every sample *extends* the saved prefix, as a resumed
    generation does; ``version`` may be one int or one per sample. Token values encode
    (sample, position) so misaligned columns show up as wrong values. ``marker`` becomes the
    rewards, to tell two writers' results apart.
    """
    g = len(lens)
    versions_per = [version] * g if isinstance(version, int) else list(version)
    rng = np.random.default_rng(seed if seed is not None else index)
    toks, lps, vers, mask, out_lens = [], [], [], [], []
    for i in range(g):
        old = prefix.sample(i) if prefix is not None and i < prefix.num_samples else None
        n_new = int(lens[i])
        start = 0 if old is None else int(old["tokens"].shape[0])
        new_tok = np.arange(start, start + n_new, dtype=np.int32) + 1000 * (i + 1)
        parts_t = [new_tok] if old is None else [old["tokens"], new_tok]
        parts_l = [(-rng.random(n_new)).astype(np.float32)]
        parts_v = [np.full(n_new, versions_per[i], dtype=np.int64)]
        parts_m = [np.ones(n_new, dtype=np.uint8)]
        if old is not None:
            parts_l.insert(0, old["logprobs"])
            parts_v.insert(0, old["versions"])
            parts_m.insert(0, old["loss_mask"])
        toks.append(np.concatenate(parts_t))
        lps.append(np.concatenate(parts_l))
        vers.append(np.concatenate(parts_v))
        mask.append(np.concatenate(parts_m))
        out_lens.append(int(toks[-1].shape[0]))
    st = list(status) if status is not None else ["completed"] * g
    return GroupData(
        task_id=task_id, index=index, prompt_ids=np.arange(4, dtype=np.int32) + index,
        sample_lens=out_lens, tokens=np.concatenate(toks) if toks else np.zeros(0),
        logprobs=np.concatenate(lps) if lps else np.zeros(0),
        versions=np.concatenate(vers) if vers else np.zeros(0),
        loss_mask=np.concatenate(mask) if mask else np.zeros(0),
        rewards=[None if s in ("pending", "aborted") else marker for s in st], status=st,
        meta={"version_hint": versions_per[0] if versions_per else 0})


def make_partial(task_id: str, index: int = 0, *, lens: Sequence[int] = (2, 1),
                 version: int | Sequence[int] = 0, prefix: GroupData | None = None,
                 ) -> GroupData:
    """A partial group: every sample aborted at a weight update, prefix saved."""
    return make_group(task_id, index, lens=lens, version=version,
                      status=["aborted"] * len(lens), prefix=prefix)
