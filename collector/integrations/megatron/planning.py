"""Micro-batch planning for a Megatron-core rank: the model-parallel shape it packs for
(``ParallelLayout``) and the cut of its shard into contiguous runs of samples under a
tokens-per-GPU budget (``plan_micro_batches``, ``sync_num_micro_batches``). Lengths only: no
tensor is touched here (the tensors are laid out by ``thd``; ``adapter`` ties both together).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_INSTALL = ("Megatron-core is not installed: pip install 'strawq[megatron]' (megatron-core==0.16.1;"
            " it uses the torch already installed)")


def packed_seq_params_cls() -> Any:
    """Megatron-core's ``PackedSeqParams`` (imported here, on first use)."""
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError as exc:  # pragma: no cover - exercised where megatron is missing
        raise ImportError(_INSTALL) from exc
    return PackedSeqParams


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The model-parallel shape a rank packs for (its data-parallel shard is the reader's)."""

    #: tensor-parallel size
    tp_size: int = 1
    #: context-parallel size and this rank's position in its CP group
    cp_size: int = 1
    cp_rank: int = 0
    #: Megatron's ``sequence_parallel`` (splits the sequence over the TP ranks too)
    sequence_parallel: bool = False
    #: extra multiple for the micro-batch's total padded length (1 = none)
    pad_multiple: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "cp_size", "pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, cp_size={self.cp_size}), got {self.cp_rank}")

    @property
    def seq_multiple(self) -> int:
        """Every sequence is padded to this multiple (2·CP chunks, × TP under SP)."""
        if self.cp_size == 1:
            return 1
        return 2 * self.cp_size * (self.tp_size if self.sequence_parallel else 1)

    @property
    def tail_multiple(self) -> int:
        """The micro-batch's padded total is a multiple of this (before the CP split)."""
        m = self.pad_multiple
        if self.cp_size == 1 and self.sequence_parallel:
            m = math.lcm(m, self.tp_size)
        elif self.cp_size > 1 and m > 1:
            # the tail is one more padded sequence: it must split into 2·CP chunks too
            m = math.lcm(m, self.seq_multiple)
        return m

    @classmethod
    def from_parallel_state(cls, *, pad_multiple: int = 1,
                            sequence_parallel: bool | None = None) -> ParallelLayout:
        """This process's layout from ``megatron.core.parallel_state`` (initialised)."""
        try:
            from megatron.core import parallel_state as ps
        except ImportError as exc:  # pragma: no cover - exercised where megatron is missing
            raise ImportError(_INSTALL) from exc
        tp = int(ps.get_tensor_model_parallel_world_size())
        return cls(tp_size=tp, cp_size=int(ps.get_context_parallel_world_size()),
                   cp_rank=int(ps.get_context_parallel_rank()),
                   sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel,
                   pad_multiple=pad_multiple)


def round_up(x: np.ndarray, m: int) -> np.ndarray:
    """Each of ``x`` rounded up to a multiple of ``m``."""
    return x if m == 1 else -(-x // m) * m


def plan_micro_batches(seqlens: Sequence[int] | np.ndarray, max_tokens: int, *,
                       seq_multiple: int = 1, min_micro_batches: int = 1) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` sample ranges whose padded tokens fit ``max_tokens``.

    The count is the fewest the budget allows (at least ``min_micro_batches``, at most one
    per sample); the split points are at equal token shares, rounded to sample boundaries
    (nearest, else down, else up), or, where none of those fits the budget, the greedy
    fill's. A sequence longer than the budget gets a micro-batch of its own (logged).
    Deterministic: the same lengths give the same plan on every rank.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    w = round_up(np.asarray(seqlens, dtype=np.int64), seq_multiple)
    n = int(w.shape[0])
    if n == 0:
        return []
    if (w < 0).any():
        raise ValueError("sequence lengths must be >= 0")
    biggest = int(w.max())
    if biggest > max_tokens:
        log.warning("a sequence of %d padded tokens exceeds the micro-batch budget of %d "
                    "tokens; it gets a micro-batch of its own", biggest, max_tokens)
    prefix = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(w, out=prefix[1:])

    def cuts(bound: int) -> list[int]:
        """Greedy ends: each part takes as many samples as fit ``bound`` (at least one)."""
        ends = []
        a = 0
        while a < n:
            b = int(np.searchsorted(prefix, prefix[a] + bound, side="right")) - 1
            b = max(b, a + 1)
            ends.append(b)
            a = b
        return ends

    greedy = cuts(max_tokens)
    k = max(len(greedy), min(max(min_micro_batches, 1), n))
    ends = _even_cuts(prefix, k, max_tokens)
    if ends is None:  # no even split fits the budget: the greedy fill (the fewest parts)
        ends = greedy
    bounds = [0, *ends]
    parts = [(bounds[i], bounds[i + 1]) for i in range(len(ends))]
    while len(parts) < k:  # min_micro_batches asks for more: halve the widest part
        i = max(range(len(parts)), key=lambda j: (parts[j][1] - parts[j][0], -j))
        a, b = parts[i]
        mid_s = a + (b - a) // 2
        parts[i:i + 1] = [(a, mid_s), (mid_s, b)]
    return parts


def _even_cuts(prefix: np.ndarray, k: int, max_tokens: int) -> list[int] | None:
    """Split points at k equal shares of the tokens, each rounded to the nearest sample
    boundary, else down, else up (vectorised); None when none of the three fits the budget
    (a part over it that is not a single sequence)."""
    n = prefix.shape[0] - 1
    targets = prefix[-1] * np.arange(1, k, dtype=np.float64) / k
    up = np.searchsorted(prefix, targets, side="left").clip(1, n)
    down = (up - 1).clip(1, n)
    nearest = np.where(np.abs(prefix[down] - targets) <= np.abs(prefix[up] - targets),
                       down, up)
    for pick in (nearest, down, up):
        bounds = np.concatenate([[0], pick, [n]]).astype(np.int64)
        width = np.diff(bounds)
        if (width <= 0).any():
            continue
        loads = prefix[bounds[1:]] - prefix[bounds[:-1]]
        if not ((loads > max_tokens) & (width > 1)).any():
            return [int(x) for x in bounds[1:]]
    return None


def sync_num_micro_batches(count: int, group: Any = None) -> int:
    """The largest count over a process group (every DP rank must run as many micro-batches
    under pipeline parallelism); pass it back as ``min_micro_batches``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return count
    t = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
