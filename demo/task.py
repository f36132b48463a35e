"""The demo's task: "write exactly k tokens, then stop".

Verifiable (``strawq.producers.rewards.count_task``) and learnable by a tiny model in minutes on
two CPU cores. Response lengths are long-tailed twice over: a fresh model rarely samples
EOS (lengths run to the cap), and k itself is long-tailed — most prompts ask for 2–9
tokens, a few for 20–64 — so partial rollout matters for the whole run.

Prompts are token ids (no tokenizer): ``[BOS, 10 + k // 10, 20 + k % 10]``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping

from strawq.producers.engines.tiny_config import TinyConfig

BOS, EOS = 1, 2
VOCAB = 32
MAX_NEW_TOKENS = 96
LONG_SHARE = 0.15


def tiny_config(seed: int = 0) -> TinyConfig:
    return TinyConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2,
                      intermediate_size=128, context_length=256, eos_token_id=EOS, seed=seed)


def prompt_for(k: int) -> list[int]:
    if not 1 <= k <= 99:
        raise ValueError(f"count must be in 1..99, got {k}")
    return [BOS, 10 + k // 10, 20 + k % 10]


def make_rows(n: int, seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(20, 64) if rng.random() < LONG_SHARE else rng.randint(2, 9)
        rows.append({"prompt": prompt_for(k), "count": k, "eos": EOS})
    return rows


def write_dataset(path: str, n: int, seed: int = 0) -> str:
    return write_jsonl(path, make_rows(n, seed))


def write_jsonl(path: str, rows: Iterable[Mapping[str, object]]) -> str:
    """A demo dataset file: one JSON object per row."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
