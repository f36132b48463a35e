"""The trainer side's oracle, its model and objective: ``Objective`` (the documented loss's
knobs), ``TinyPolicy`` and ``PaddedPolicy`` (small deterministic models over packed or padded
sequences), and the helpers every path uses to run them.

Part of ``strawq.testing.reference``, which exports all of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from strawq.collector.trainer.importance import (DEFAULT_LOSS_AGG, LOSS_AGG_MODES,
                                                 masked_tis_weights, policy_logprobs)
from strawq.collector.trainer.reader import Batch

#: the importance weights the objective can apply (``none``: w = 1, plain policy gradient)
IS_MODES = ("tis", "icepop", "icepop_mask", "none")

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """The documented RL objective, as options."""

    #: loss reduction (``importance.LOSS_AGG_MODES``)
    aggregation: str = DEFAULT_LOSS_AGG
    #: importance weight (``IS_MODES``)
    is_mode: str = "tis"
    #: score with the recorded top-k / top-p truncation as well as the temperature (for
    #: engines that record truncated log-probs); False: temperature only, SGLang's default
    #: log-prob convention
    truncated: bool = False

    def __post_init__(self) -> None:
        if self.aggregation not in LOSS_AGG_MODES:
            raise ValueError(f"aggregation must be one of {LOSS_AGG_MODES}, got "
                             f"{self.aggregation!r}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode must be one of {IS_MODES}, got {self.is_mode!r}")

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor,
                 temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor) -> torch.Tensor:
        """log π(targets) under the behaviour sampling transform this objective scores."""
        if self.truncated:
            return policy_logprobs(logits, targets, temperature, top_p=top_p, top_k=top_k)
        return policy_logprobs(logits, targets, temperature)

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor,
                   rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                   advantages: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor) -> torch.Tensor:
        """Per token −w · A · log π (unmasked: the aggregation applies ``loss_mask``)."""
        logp = self.logprobs(logits, targets, temperature, top_p, top_k)
        if self.is_mode == "none":
            w = torch.ones_like(logp)
        else:
            w = masked_tis_weights(logp, rollout_logprobs, torch.ones_like(loss_mask),
                                   mode=self.is_mode)
        return -(w * advantages.to(logp.dtype) * logp)


#: the objective with its defaults (the default argument of the oracle and the paths)
DEFAULT_OBJECTIVE = Objective()


class TinyPolicy(torch.nn.Module):
    """A deterministic packed-sequence model: ``forward(tokens [N], positions [N],
    cu_seqlens [S + 1]) -> logits [N, V]``.

    h_t = tanh(E[x_t] + P[pos_t] + mean_{s ≤ t in its sequence}(E[x_s]) · M); logits = h · O.
    The causal context stops at each ``cu_seqlens`` boundary (the prefix sums run in
    float64, so packing more sequences together does not change the figures beyond fp32
    rounding). Token ids are taken modulo ``vocab``. The same ``seed`` gives the same
    weights on every process and device.
    """

    def __init__(self, vocab: int = 64, hidden: int = 16, max_len: int = 1024,
                 seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.max_len = vocab, max_len
        self.emb = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(max_len, hidden, generator=g) * 0.1)
        self.mix = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.3)
        self.out = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        tok = tokens.to(torch.int64).remainder(self.vocab)
        e = self.emb[tok]
        n = tok.shape[0]
        cu = cu_seqlens.to(torch.int64).to(tok.device)
        lens = cu[1:] - cu[:-1]
        seg = torch.repeat_interleave(torch.arange(lens.numel(), device=tok.device), lens)
        if seg.shape[0] != n:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])}, tokens has {n}: expected "
                             "the packed layout of the tokens")
        csum = torch.cat([e.new_zeros((1, e.shape[1]), dtype=torch.float64),
                          e.double().cumsum(0)])
        start = cu[:-1][seg]
        idx = torch.arange(n, device=tok.device)
        prefix = (csum[idx + 1] - csum[start]) / (idx - start + 1).unsqueeze(1).double()
        pos = positions.to(torch.int64).clamp(0, self.max_len - 1)
        h = torch.tanh(e + self.pos[pos] + prefix.to(e.dtype) @ self.mix)
        out: torch.Tensor = h @ self.out
        return out


class PaddedPolicy(torch.nn.Module):
    """``TinyPolicy`` on padded rows ``[S, L]``: the demo trainer's model interface."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.inner = TinyPolicy(**kwargs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s, length = tokens.shape
        cu = torch.arange(0, s * length + 1, max(length, 1), device=tokens.device)
        pos = torch.arange(length, device=tokens.device).repeat(s)
        out: torch.Tensor = self.inner(tokens.reshape(-1), pos, cu).reshape(s, length, -1)
        return out


def positions_from_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [T]: each token's position within its sequence (on ``cu_seqlens``' device)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    return torch.arange(int(cu[-1]), device=cu.device) - torch.repeat_interleave(cu[:-1], lens)


def device_of(model: torch.nn.Module) -> torch.device:
    for q in model.parameters():
        return q.device
    return torch.device("cpu")


def zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """A zero connected to every parameter (their gradients exist, and are 0)."""
    return sum((q.sum() * 0.0 for q in model.parameters()),
               torch.zeros((), device=device_of(model)))


def batch_to(batch: Batch, device: torch.device | str) -> Batch:
    """A copy of a reader ``Batch`` with every tensor on ``device``."""

    moved: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            moved[f.name] = v.to(device)
        elif f.name == "extras":
            moved[f.name] = {k: t.to(device) for k, t in v.items()}
    return dataclasses.replace(batch, **moved)
