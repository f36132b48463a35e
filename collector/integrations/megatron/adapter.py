"""Megatron-core adapter: a reader ``Batch`` → THD micro-batches for one rank.

What a Megatron-core trainer needs from one data-parallel rank's shard:

* **dynamic batch size**: micro-batches formed under a tokens-per-GPU budget
  (``max_tokens_per_gpu``, counted after the context-parallel split, as slime's flag of the
  same name). The shard is cut into *contiguous* runs of samples (``plan_micro_batches``):
  the fewest micro-batches the budget allows, split at equal token shares where that fits.
  Contiguous runs keep the shard's staleness-first order and GRPO groups together, and let
  the common case (no context parallelism, no padding) hand out *views* of the reader's
  tensors, one ``torch.split`` per column: the adapter then costs a few calls per
  micro-batch, whatever the token count.
* **THD packing** with ``megatron.core.packed_seq_params.PackedSeqParams``
  (``qkv_format="thd"``; ``cu_seqlens_q`` over the real lengths, ``cu_seqlens_q_padded`` over
  the padded ones, both in the global, pre-split layout as Megatron's THD attention expects).
* **padding** to the parallel multiples: with context parallelism (CP > 1) every sequence is
  padded to a multiple of 2·CP (× TP under sequence parallelism), so that it splits into 2·CP
  equal chunks; without CP, sequence parallelism pads the micro-batch's tail to a multiple
  of TP (as one extra padding "sequence" in ``cu_seqlens``). ``pad_multiple`` adds a tail
  multiple of your own (e.g. 128 against memory fragmentation).
* **load-balanced CP split**: each (padded) sequence is cut into 2·CP chunks and CP rank r
  keeps chunks r and 2·CP−1−r (Megatron's ``get_batch_on_this_cp_rank`` /
  Transformer Engine's ``thd_get_partitioned_indices`` layout), so causal attention work is
  even over the CP ranks.
* **next-token alignment**: Megatron's loss at position t scores ``labels[t]``, the token
  at t + 1. Every per-token tensor that describes a *generated* token (loss mask, rollout
  log-probs, versions, advantages, ``target`` extras) is shifted with the labels, so
  ``rollout_logprobs[t]`` is the engine's log-prob of ``labels[t]``. The last position of
  every sequence has ``loss_mask`` 0 (what follows it in the stream is the next sample's
  first prompt token, or padding, and is never trained). ``input`` extras (e.g. routed
  experts, recorded per input position) are not shifted.
* **the behaviour policy and the loss denominators per label**: ``temperature``, ``top_p``
  and ``top_k`` are each label's sample's recorded sampling parameters (score at
  ``temperature``: the engines record tempered log-probs), ``sample_loss_tokens`` its
  sample's trained tokens over every CP rank, and ``totals`` the whole batch's
  denominators with DP × CP as the ranks averaged over: ``importance.batch_loss(per_token,
  mb, mode)`` summed over a rank's micro-batches, gradients averaged over DP × CP, is the
  single-process gradient of the whole batch (docs/design.md, invariant 11).

Dtypes are the reader's (int32 ids, uint8 mask, float32 log-probs and advantages, int64
versions): Megatron's embedding and ``vocab_parallel_cross_entropy`` take int32 ids, and
half the bytes cross the host-to-device link; convert on the device when a kernel wants
int64 or a float mask.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from strawq.collector.trainer.importance import LossTotals
from strawq.collector.trainer.reader import Batch
from strawq.extras import SPECS

log = logging.getLogger(__name__)

Align = Literal["input", "target"]

_INSTALL = ("Megatron-core is not installed: pip install 'strawq[megatron]' (megatron-core==0.16.1;"
            " it uses the torch already installed)")


def _packed_seq_params_cls() -> Any:
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


def _round_up(x: np.ndarray, m: int) -> np.ndarray:
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
    w = _round_up(np.asarray(seqlens, dtype=np.int64), seq_multiple)
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


@dataclass
class MicroBatch:
    """One micro-batch for one rank: ``[1, t]`` tensors in THD layout (this CP rank's part).

    ``t`` is the padded token count divided by CP. ``labels[0, i]`` is the token after
    ``tokens[0, i]`` within its sequence; ``loss_mask``, ``rollout_logprobs``, ``versions``,
    ``advantages`` and the ``target`` extras are aligned with ``labels``.
    """

    #: int32 [1, t] input ids
    tokens: torch.Tensor
    #: int32 [1, t] next-token targets
    labels: torch.Tensor
    #: uint8 [1, t] 1 where the label is a trained response token
    loss_mask: torch.Tensor
    #: float32 [1, t] the engine's log-prob of each label (0 where not generated)
    rollout_logprobs: torch.Tensor
    #: int64 [1, t] weight version that generated each label (−1 where not generated)
    versions: torch.Tensor
    #: float32 [1, t] the sample's advantage (meaningful where loss_mask is 1)
    advantages: torch.Tensor
    #: THD parameters for the model's forward (``megatron.core.packed_seq_params``)
    packed_seq_params: Any
    #: int64 [n]: positions of this micro-batch's samples in the reader's ``Batch``
    sample_ids: torch.Tensor
    #: int32 [n]: real and padded lengths of its samples (global, before the CP split)
    seqlens: torch.Tensor
    padded_seqlens: torch.Tensor
    #: per-token extras, aligned as declared (``input``: with tokens, ``target``: with labels)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the whole batch's loss denominators and the ranks gradients are averaged over
    #: (DP × CP): ``importance.batch_loss(per_token, mb, mode)`` is this micro-batch's share
    #: of the batch's loss; sum it over the rank's micro-batches
    totals: LossTotals | None = None
    #: per sample [n]: its recorded ``temperature``, ``top_p`` (float32), ``top_k`` (int32)
    #: and ``loss_tokens`` (float32, its trained tokens over the whole sample); the
    #: per-token properties of the same names expand them
    sample_columns: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the CP size it was cut for (each sequence holds padded length ÷ CP positions here)
    cp_size: int = 1
    #: int64 [1, t] position of each token within its sequence, when built by the padded path
    _positions: torch.Tensor | None = None
    _expanded: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    # -- per-label sampling parameters and loss denominators (expanded on first use) --------
    @property
    def temperature(self) -> torch.Tensor:
        """float32 [1, t]: the temperature each label was sampled at (its sample's recorded
        one): score ``labels`` with ``policy_logprobs(logits, labels, temperature)`` (or
        Megatron's cross-entropy of ``logits / temperature``) so an on-policy token has
        ratio 1. Meaningful where ``loss_mask`` is 1."""
        return self._per_token("temperature", 1.0)

    @property
    def top_p(self) -> torch.Tensor:
        """float32 [1, t]: each label's sample's recorded top-p (where ``loss_mask`` is 1)."""
        return self._per_token("top_p", 1.0)

    @property
    def top_k(self) -> torch.Tensor:
        """int32 [1, t]: each label's sample's recorded top-k, −1 = all (where
        ``loss_mask`` is 1)."""
        return self._per_token("top_k", -1)

    @property
    def sample_loss_tokens(self) -> torch.Tensor:
        """float32 [1, t]: the trained tokens of each label's sample over the whole sample
        (every CP rank's part): the ``seq_mean_token_mean`` denominator of ``batch_loss``."""
        return self._per_token("loss_tokens", 0.0)

    def token_samples(self) -> torch.Tensor:
        """int64 [1, t]: each position's sample (an index into ``sample_ids``); −1 over the
        tail padding. A trained label belongs to its position's sample (every sample starts
        with a prompt token)."""
        per = self.padded_seqlens.to(torch.int64) // self.cp_size
        idx = torch.repeat_interleave(torch.arange(per.numel()), per)
        if idx.shape[0] < self.num_tokens:
            idx = torch.cat([idx, torch.full((self.num_tokens - idx.shape[0],), -1,
                                             dtype=torch.int64)])
        return idx.view(1, -1)

    def _per_token(self, name: str, fill: float) -> torch.Tensor:
        got = self._expanded.get(name)
        if got is not None:
            return got
        v = self.sample_columns.get(name)
        t = self.num_tokens
        if v is None or v.numel() == 0:
            dtype = torch.int32 if name == "top_k" else torch.float32
            out = torch.full((1, t), fill, dtype=dtype, device=self.tokens.device)
        elif bool((v == v[0]).all()):  # one value for the whole micro-batch: a view
            out = v[:1].view(1, 1).expand(1, t)
        else:
            idx = self.token_samples()[0].to(v.device)
            out = torch.where(idx >= 0, v[idx.clamp(min=0)],
                              torch.full((), fill, dtype=v.dtype, device=v.device)).view(1, -1)
        self._expanded[name] = out
        return out

    @property
    def num_tokens(self) -> int:
        """Tokens on this rank (padding included)."""
        return int(self.tokens.shape[1])

    @property
    def num_samples(self) -> int:
        return int(self.sample_ids.shape[0])

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def position_ids(self) -> torch.Tensor:
        """int64 [1, t]: position within the sequence (learned absolute embeddings need it;
        RoPE under THD takes positions from ``cu_seqlens``)."""
        if self._positions is not None:
            return self._positions
        lens = self.padded_seqlens.to(torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(int(lens.sum()), dtype=torch.int64)
        pos -= torch.repeat_interleave(starts, lens)
        if pos.shape[0] < self.num_tokens:  # the tail padding sequence
            tail = torch.arange(self.num_tokens - pos.shape[0], dtype=torch.int64)
            pos = torch.cat([pos, tail])
        return pos.view(1, -1)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> MicroBatch:
        """A copy on ``device`` (the packed-sequence parameters included)."""
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        psp = self.packed_seq_params
        cls = type(psp)
        new_psp = cls(qkv_format=psp.qkv_format, cu_seqlens_q=mv(psp.cu_seqlens_q),
                      cu_seqlens_kv=mv(psp.cu_seqlens_kv),
                      cu_seqlens_q_padded=mv(psp.cu_seqlens_q_padded),
                      cu_seqlens_kv_padded=mv(psp.cu_seqlens_kv_padded),
                      max_seqlen_q=psp.max_seqlen_q, max_seqlen_kv=psp.max_seqlen_kv)
        return _micro_batch(
            {name: mv(getattr(self, name)) for name in COLUMN_NAMES},
            packed_seq_params=new_psp, sample_ids=self.sample_ids, seqlens=self.seqlens,
            padded_seqlens=self.padded_seqlens, extras={k: mv(v) for k, v in self.extras.items()},
            totals=self.totals, sample_columns={k: mv(v) for k, v in self.sample_columns.items()},
            cp_size=self.cp_size,
            _positions=None if self._positions is None else mv(self._positions))


def _micro_batch(cols: Mapping[str, torch.Tensor], **kw: Any) -> MicroBatch:
    """A ``MicroBatch`` from its per-token columns (``COLUMN_NAMES``) and the rest."""
    return MicroBatch(tokens=cols["tokens"], labels=cols["labels"], loss_mask=cols["loss_mask"],
                      rollout_logprobs=cols["rollout_logprobs"], versions=cols["versions"],
                      advantages=cols["advantages"], **kw)


@dataclass
class _Shard:
    """Per-batch arrays every micro-batch slices (computed once per ``micro_batches``)."""

    cu: np.ndarray
    cu32: np.ndarray
    lens: np.ndarray
    lens_t: torch.Tensor
    ids_t: torch.Tensor


#: column name → (fill value past the data, aligned with labels?)
_COLUMNS: tuple[tuple[str, float, bool], ...] = (
    ("tokens", 0, False), ("labels", 0, True), ("loss_mask", 0, True),
    ("rollout_logprobs", 0.0, True), ("versions", -1, True), ("advantages", 0.0, True))
#: the per-token fields of a ``MicroBatch``
COLUMN_NAMES = tuple(name for name, _, _ in _COLUMNS)


class MegatronBatcher:
    """Cuts a reader ``Batch`` into micro-batches for one rank of a Megatron-core job.

    ``max_tokens_per_gpu`` is the budget per GPU *after* the CP split (the micro-batch holds
    up to ``max_tokens_per_gpu · cp_size`` padded tokens before it). ``pad_token_id`` fills
    padding. ``min_micro_batches`` forces at least that many (see
    ``sync_num_micro_batches``).
    """

    def __init__(self, layout: ParallelLayout | None = None, *, max_tokens_per_gpu: int,
                 pad_token_id: int = 0) -> None:
        self.layout = layout or ParallelLayout()
        if max_tokens_per_gpu < 1:
            raise ValueError(f"max_tokens_per_gpu must be >= 1, got {max_tokens_per_gpu}")
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.pad_token_id = pad_token_id
        self._psp = _packed_seq_params_cls()
        self._rows: dict[int, torch.Tensor] = {}
        self._totals: LossTotals | None = None
        self._samples: dict[str, torch.Tensor] = {}

    def plan(self, batch: Batch, *, min_micro_batches: int = 1) -> list[tuple[int, int]]:
        """The micro-batches' sample ranges (cheap: lengths only)."""
        lens = np.diff(batch.cu_seqlens.numpy())
        return plan_micro_batches(lens, self.max_tokens_per_gpu * self.layout.cp_size,
                                  seq_multiple=self.layout.seq_multiple,
                                  min_micro_batches=min_micro_batches)

    def micro_batches(self, batch: Batch, *, min_micro_batches: int = 1,
                      extras: Mapping[str, torch.Tensor] | None = None,
                      extra_align: Mapping[str, Align] | None = None) -> list[MicroBatch]:
        """Every micro-batch of ``batch`` for this rank, in plan order.

        ``extras``: per-token tensors ``[T, ...]`` over the batch's packed tokens (e.g. teacher
        log-probs, routed experts); None: the batch's own fixed-row extras (``Batch.extras``,
        the ragged top-p ids aside). ``extra_align[name]`` is ``"target"`` (default: shifted
        with the labels) or ``"input"`` (aligned with the tokens; the default of a prompt
        extra such as ``routed_experts``, the routing of each input token).
        """
        cols = self._columns(batch)
        if extras is None:
            extras = {n: t for n, t in batch.extras.items()
                      if n in SPECS and not SPECS[n].ragged}
        ext = dict(extras)
        align: dict[str, Align] = {n: "input" for n in ext if n in SPECS and SPECS[n].prompt}
        align.update(extra_align or {})
        total = batch.num_tokens
        for name, t in ext.items():
            if t.shape[0] != total:
                raise ValueError(f"extra {name!r} has {t.shape[0]} rows, the batch has {total} "
                                 "tokens")
            if align.setdefault(name, "target") not in ("input", "target"):
                raise ValueError(f"extra_align[{name!r}] must be 'input' or 'target'")
        cu = batch.cu_seqlens.numpy().astype(np.int64)
        if cu.shape[0] > 2 and batch.loss_mask[torch.from_numpy(cu[1:-1])].any():
            raise ValueError("a sample starts with a trained token (no prompt): the next-token "
                             "shift needs every sample to start with a prompt token")
        self._rows = {id(t): t.unsqueeze(0) for t in (*cols.values(), *ext.values())}
        bt = batch.totals
        self._totals = LossTotals(total_samples=bt.total_samples,
                                  total_loss_tokens=bt.total_loss_tokens,
                                  grad_ranks=bt.grad_ranks * self.layout.cp_size)
        self._samples = self._sample_columns(batch, cu)
        lens = np.diff(cu)
        shard = _Shard(cu=cu, cu32=cu.astype(np.int32), lens=lens,
                       lens_t=torch.from_numpy(lens.astype(np.int32)),
                       ids_t=torch.arange(lens.shape[0], dtype=torch.int64))
        parts = self.plan(batch, min_micro_batches=min_micro_batches)
        try:
            if parts and self.layout.seq_multiple == 1 and self.layout.tail_multiple == 1:
                return self._all_views(cols, ext, align, shard, parts)
            return [self._build(cols, ext, align, shard, a, b) for a, b in parts]
        finally:
            self._rows = {}
            self._samples = {}

    # -- building ----------------------------------------------------------------------------
    @staticmethod
    def _columns(batch: Batch) -> dict[str, torch.Tensor]:
        return {"tokens": batch.tokens, "labels": batch.tokens, "loss_mask": batch.loss_mask,
                "rollout_logprobs": batch.rollout_logprobs, "versions": batch.versions,
                "advantages": batch.advantages}

    @staticmethod
    def _sample_columns(batch: Batch, cu: np.ndarray) -> dict[str, torch.Tensor]:
        """Per sample [S]: the recorded sampling parameters and the trained-token count."""
        n = batch.num_samples
        mask = batch.loss_mask.numpy()
        lens = np.diff(cu)
        if n and mask.shape[0]:
            starts = np.minimum(cu[:-1], mask.shape[0] - 1)
            counts = np.add.reduceat(mask, starts, dtype=np.int64)
            counts[lens == 0] = 0
        else:
            counts = np.zeros(n, dtype=np.int64)
        return {
            "temperature": batch.temperature if batch.temperature is not None
            else torch.ones(n, dtype=torch.float32),
            "top_p": batch.top_p if batch.top_p is not None
            else torch.ones(n, dtype=torch.float32),
            "top_k": batch.top_k if batch.top_k is not None
            else torch.full((n,), -1, dtype=torch.int32),
            "loss_tokens": torch.from_numpy(counts.astype(np.float32))}

    def _build(self, cols: dict[str, torch.Tensor], ext: dict[str, torch.Tensor],
               align: dict[str, Align], shard: _Shard, a: int, b: int) -> MicroBatch:
        lay = self.layout
        cu = shard.cu
        start, end = int(cu[a]), int(cu[b])
        if lay.seq_multiple == 1 and (end - start) % lay.tail_multiple == 0:
            # the common case, kept to a few cheap calls: no padding, views of the columns
            fields, extras = self._views(cols, ext, align, start, end)
            cu_t = torch.from_numpy(shard.cu32[a:b + 1] - shard.cu32[a])
            max_len = int(shard.lens[a:b].max())
            psp = self._psp(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                            cu_seqlens_q_padded=cu_t, cu_seqlens_kv_padded=cu_t,
                            max_seqlen_q=max_len, max_seqlen_kv=max_len)
            lens_t = shard.lens_t[a:b]
            return _micro_batch(fields, packed_seq_params=psp, sample_ids=shard.ids_t[a:b],
                              seqlens=lens_t, padded_seqlens=lens_t, extras=extras,
                              totals=self._totals,
                              sample_columns={k: v[a:b] for k, v in self._samples.items()})
        lens = shard.lens[a:b]
        plens = _round_up(lens, lay.seq_multiple)
        real = int(plens.sum())
        tail = (-real) % lay.tail_multiple
        seq_cu = np.zeros(lens.shape[0] + 1 + (tail > 0), dtype=np.int32)
        np.cumsum(lens, out=seq_cu[1:lens.shape[0] + 1])
        pad_cu = np.zeros_like(seq_cu)
        np.cumsum(plens, out=pad_cu[1:lens.shape[0] + 1])
        if tail:
            seq_cu[-1] = seq_cu[-2] + tail
            pad_cu[-1] = pad_cu[-2] + tail
        max_len = int(max(plens.max(initial=0), tail))
        fields, extras, positions = self._gather(cols, ext, align, cu, a, b, plens, tail)
        cu_t = torch.from_numpy(seq_cu)
        pad_t = torch.from_numpy(pad_cu)
        psp = self._psp(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                        cu_seqlens_q_padded=pad_t, cu_seqlens_kv_padded=pad_t,
                        max_seqlen_q=max_len, max_seqlen_kv=max_len)
        return _micro_batch(fields, packed_seq_params=psp,
                          sample_ids=torch.arange(a, b, dtype=torch.int64),
                          seqlens=torch.from_numpy(lens.astype(np.int32)),
                          padded_seqlens=torch.from_numpy(plens.astype(np.int32)),
                          extras=extras, totals=self._totals,
                          sample_columns={k: v[a:b] for k, v in self._samples.items()},
                          cp_size=lay.cp_size, _positions=positions)

    def _all_views(self, cols: dict[str, torch.Tensor], ext: dict[str, torch.Tensor],
                   align: dict[str, Align], shard: _Shard, parts: list[tuple[int, int]]
                   ) -> list[MicroBatch]:
        """No padding, no CP split, for every micro-batch at once: each column is split into
        views with one call (the parts cover the shard's tokens end to end); the shifted
        columns copy only their last part, whose last label lies past the data."""
        cu, cu32, k = shard.cu, shard.cu32, len(parts)
        starts = np.fromiter((a for a, _ in parts), dtype=np.int64, count=k)
        counts = np.fromiter((b - a for a, b in parts), dtype=np.int64, count=k)
        sizes = np.diff(cu[np.append(starts, cu.shape[0] - 1)]).tolist()
        pad = self.pad_token_id

        def split(t: torch.Tensor, shifted: bool, fill: float) -> list[torch.Tensor]:
            row = self._rows[id(t)]  # [1, T, ...]
            if not shifted:
                return list(torch.split(row, sizes, dim=1))
            out = list(torch.split(row[:, 1:], [*sizes[:-1], sizes[-1] - 1], dim=1))
            last = row.new_empty((1, sizes[-1], *t.shape[1:]))
            last[0, :-1] = out[-1][0]
            last[0, -1] = fill
            out[-1] = last
            return out

        fields = {name: split(cols[name], shifted, pad if name in ("tokens", "labels") else fill)
                  for name, fill, shifted in _COLUMNS}
        extras = {n: split(t, align[n] == "target", 0) for n, t in ext.items()}
        # each part's cu_seqlens: its boundaries [a, b] minus its first token offset
        span = counts + 1
        first = np.repeat(np.cumsum(span) - span, span)
        idx = np.arange(int(span.sum()), dtype=np.int64) - first + np.repeat(starts, span)
        local = cu32[idx] - np.repeat(cu32[starts], span)
        cus = torch.split(torch.from_numpy(local), span.tolist())
        maxes = np.maximum.reduceat(shard.lens, starts).tolist()
        lens = torch.split(shard.lens_t, counts.tolist())
        ids = torch.split(shard.ids_t, counts.tolist())
        per_sample = {n: torch.split(v, counts.tolist()) for n, v in self._samples.items()}
        psp_cls = self._psp
        out = []
        for i in range(k):
            c = cus[i]
            psp = psp_cls(qkv_format="thd", cu_seqlens_q=c, cu_seqlens_kv=c,
                          cu_seqlens_q_padded=c, cu_seqlens_kv_padded=c,
                          max_seqlen_q=maxes[i], max_seqlen_kv=maxes[i])
            out.append(_micro_batch(
                {name: fields[name][i] for name in COLUMN_NAMES},
                packed_seq_params=psp, sample_ids=ids[i], seqlens=lens[i],
                padded_seqlens=lens[i], extras={n: v[i] for n, v in extras.items()},
                totals=self._totals, sample_columns={n: v[i] for n, v in per_sample.items()}))
        return out

    def _views(self, cols: dict[str, torch.Tensor], ext: dict[str, torch.Tensor],
               align: dict[str, Align], start: int, end: int
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """No padding, no CP split: views of the reader's tensors (the shifted ones copy only
        for the shard's last micro-batch, whose last label lies past the data)."""
        rows = self._rows
        def cut(t: torch.Tensor, shifted: bool, fill: float) -> torch.Tensor:
            t2 = rows[id(t)]  # [1, T, ...]: one slicing call per column
            if not shifted:
                return t2[:, start:end]
            if end < t.shape[0]:
                return t2[:, start + 1:end + 1]
            out = t2.new_empty((1, end - start, *t.shape[1:]))
            out[0, :end - start - 1] = t[start + 1:end]
            out[0, end - start - 1] = fill
            return out

        pad = self.pad_token_id
        fields = {name: cut(cols[name], shifted, pad if name in ("tokens", "labels") else fill)
                  for name, fill, shifted in _COLUMNS}
        extras = {k: cut(t, align[k] == "target", 0) for k, t in ext.items()}
        return fields, extras

    def _gather(self, cols: dict[str, torch.Tensor], ext: dict[str, torch.Tensor],
                align: dict[str, Align], cu: np.ndarray, a: int, b: int, plens: np.ndarray,
                tail: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """Padding and/or the CP split: one index per alignment, one gather per column."""
        lay = self.layout
        cp, r = lay.cp_size, lay.cp_rank
        starts = cu[a:b]
        lens = cu[a + 1:b + 1] - starts
        n = lens.shape[0]
        if cp > 1:
            # chunk r and chunk 2cp-1-r of every padded sequence
            chunk = plens // (2 * cp)
            run_seq = np.repeat(np.arange(n), 2)
            run_off = np.empty(2 * n, dtype=np.int64)
            run_off[0::2] = r * chunk
            run_off[1::2] = (2 * cp - 1 - r) * chunk
            run_len = np.repeat(chunk, 2)
        else:
            run_seq = np.arange(n)
            run_off = np.zeros(n, dtype=np.int64)
            run_len = plens
        total = int(run_len.sum())
        run_start = np.zeros(run_len.shape[0], dtype=np.int64)
        np.cumsum(run_len[:-1], out=run_start[1:])
        seq_of = np.repeat(run_seq, run_len)
        # offset of each output position within its (padded) sequence
        j = np.arange(total, dtype=np.int64) - np.repeat(run_start - run_off, run_len)
        t_len = int(cols["tokens"].shape[0])
        lo, hi = int(starts[0]), min(int(cu[b]) + 1, t_len)  # the sources this part reads
        fill_at = hi - lo  # index of the fill row appended after them
        ok_in = j < lens[seq_of]
        src_in = np.where(ok_in, starts[seq_of] + j - lo, fill_at)
        src_tg = np.where(ok_in & (src_in + 1 + lo < t_len), src_in + 1, fill_at)
        if tail:
            # the tail padding sequence, split like the others (chunks r and 2cp-1-r)
            if cp > 1:
                c = tail // (2 * cp)
                j_tail = np.concatenate([np.arange(r * c, (r + 1) * c),
                                         np.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
            else:
                j_tail = np.arange(tail)
            tail_fill = np.full(j_tail.shape[0], fill_at, dtype=np.int64)
            j = np.concatenate([j, j_tail.astype(np.int64)])
            src_in = np.concatenate([src_in, tail_fill])
            src_tg = np.concatenate([src_tg, tail_fill])
        idx = {False: torch.from_numpy(src_in), True: torch.from_numpy(src_tg)}

        def take(t: torch.Tensor, shifted: bool, fill: float) -> torch.Tensor:
            ext = torch.cat([t[lo:hi], t.new_full((1, *t.shape[1:]), fill)])
            return ext.index_select(0, idx[shifted]).unsqueeze(0)

        pad = self.pad_token_id
        fields = {name: take(cols[name], shifted, pad if name in ("tokens", "labels") else fill)
                  for name, fill, shifted in _COLUMNS}
        extras = {k: take(t, align[k] == "target", 0) for k, t in ext.items()}
        return fields, extras, torch.from_numpy(j).view(1, -1)
