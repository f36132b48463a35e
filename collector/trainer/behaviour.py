"""The behaviour policy of every trained sample, as the trainer needs it (docs/design.md, invariant
10).

A token's behaviour policy is the weight version that produced it (the ``versions``
column) *and* the sampling parameters it was drawn with: temperature, top-p and top-k
change the distribution the rollout log-probs are under. Producers record each sample's
``SamplerParams`` in the group record's ``meta["params"]`` (constant over its segments: a
resumed sample keeps its recorded parameters); ``sampling_columns`` turns the summaries of a
batch into per-sample columns for ``strawq.collector.trainer.reader.Batch``. Records without them
(older runs, test producers) read as the engine defaults T = 1, top-p = 1, top-k = −1.

``read_time_staleness`` is the η re-check at read time: the collector judged a batch
against the version it expected it to be trained at (``trained_at`` in the manifest, the
prefetched batches ahead counted); the reader measures each sample against the version
current when the trainer takes the batch, so what the trainer trains is what is checked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strawq.tasks.eta import EtaPolicy

log = logging.getLogger(__name__)

DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def sampling_columns(summaries: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Per sample, in batch order: ``temperature`` and ``top_p`` (float32), ``top_k`` (int32)."""
    temp: list[float] = []
    top_p: list[float] = []
    top_k: list[int] = []
    for s in summaries:
        g = len(s.get("sample_lens", ()))
        params = (s.get("meta") or {}).get("params") or []
        for i in range(g):
            p = params[i] if i < len(params) and isinstance(params[i], Mapping) else {}
            temp.append(float(p.get("temperature", DEFAULTS["temperature"])))
            top_p.append(float(p.get("top_p", DEFAULTS["top_p"])))
            top_k.append(int(p.get("top_k", DEFAULTS["top_k"])))
    return {"temperature": np.asarray(temp, dtype=np.float32),
            "top_p": np.asarray(top_p, dtype=np.float32),
            "top_k": np.asarray(top_k, dtype=np.int32)}


def read_time_staleness(version: int, sample_staleness: np.ndarray,
                        meta: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, float]]:
    """Which samples are over the manifest's η at the version they are read at, and stats.

    Returns a bool mask [S] (all False, and no figures, when the run has no bound) and
    ``staleness/*`` figures: ``over_eta_frac`` (share of samples over η now) and
    ``read_minus_planned`` (versions the batch is read after the one the collector planned
    it for: > 0 means more batches were prefetched or trained in between than it counted).
    """
    policy = EtaPolicy.from_meta(meta)
    if not policy.bounded:  # no bound: nothing to re-check
        return np.zeros(sample_staleness.shape, dtype=bool), {}
    eta = policy.max_staleness
    planned = meta.get("trained_at", meta.get("version", version))
    stats = {"staleness/read_minus_planned": float(version - int(planned))}
    # the one judgement, on each sample's oldest version (version − its staleness)
    over = policy.over_each(version, version - np.asarray(sample_staleness))
    stats["staleness/over_eta_frac"] = float(over.mean()) if over.size else 0.0
    if over.any():  # expected under eta_mode "train" (kept and counted); a breach otherwise
        log.log(logging.INFO if meta.get("eta_mode") == "train" else logging.WARNING,
                "batch read at version %d (planned for %s): %d of %d samples are staler "
                "than eta %s; eta_mode %r", version, planned, int(over.sum()), over.size,
                eta, meta.get("eta_mode"))
    return over, stats
