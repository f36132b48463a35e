"""One micro-batch for one Megatron-core rank (``MicroBatch``): its per-token columns in
THD layout, its packed-sequence parameters, and the per-label sampling parameters and loss
denominators it expands from its samples' columns on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from strawq.collector.trainer.importance import LossTotals

#: how a per-token extra lines up: ``input`` with the tokens, ``target`` with the labels
Align = Literal["input", "target"]


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
        return make_micro_batch(
            {name: mv(getattr(self, name)) for name in COLUMN_NAMES},
            packed_seq_params=new_psp, sample_ids=self.sample_ids, seqlens=self.seqlens,
            padded_seqlens=self.padded_seqlens, extras={k: mv(v) for k, v in self.extras.items()},
            totals=self.totals, sample_columns={k: mv(v) for k, v in self.sample_columns.items()},
            cp_size=self.cp_size,
            _positions=None if self._positions is None else mv(self._positions))


def make_micro_batch(cols: Mapping[str, torch.Tensor], **kw: Any) -> MicroBatch:
    """A ``MicroBatch`` from its per-token columns (``COLUMN_NAMES``) and the rest."""
    return MicroBatch(tokens=cols["tokens"], labels=cols["labels"], loss_mask=cols["loss_mask"],
                      rollout_logprobs=cols["rollout_logprobs"], versions=cols["versions"],
                      advantages=cols["advantages"], **kw)


#: column name → (fill value past the data, aligned with labels?)
COLUMNS: tuple[tuple[str, float, bool], ...] = (
    ("tokens", 0, False), ("labels", 0, True), ("loss_mask", 0, True),
    ("rollout_logprobs", 0.0, True), ("versions", -1, True), ("advantages", 0.0, True))
#: the per-token fields of a ``MicroBatch``
COLUMN_NAMES = tuple(name for name, _, _ in COLUMNS)
