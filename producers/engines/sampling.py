"""Batched sampling for the tiny engine (temperature, top-k, top-p, min-p, greedy).

The random number of each row comes from :mod:`strawq.producers.engines.seeding`.
"""

from __future__ import annotations

import torch

from strawq.producers.engines.seeding import position_uniform  # noqa: F401  (re-export)
from strawq.producers.engines.tiny_model import GREEDY_TEMPERATURE


def sample_batch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    top_ks: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(token_ids[B] int64, logprobs[B] float32)``.

    The log-prob is that of the temperature-scaled distribution before truncation (see
    ``tiny_model`` docstring); greedy rows use the unscaled distribution.
    """
    logits = logits.float()
    greedy = temperatures < GREEDY_TEMPERATURE
    safe_t = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    logp = torch.log_softmax(logits / safe_t[:, None], dim=-1)
    probs = logp.exp()
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    k = torch.where(top_ks < 1, torch.full_like(top_ks, vocab), top_ks)
    keep = ranks < k[:, None]
    cum_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep &= cum_before < top_ps[:, None]
    keep &= sorted_p >= (min_ps * sorted_p[:, 0])[:, None]
    keep[:, 0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    cdf = kept.cumsum(dim=-1)
    target = uniforms.float()[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    # never pick a zero-probability tail entry
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1)
    sampled = order.gather(-1, pick).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    unscaled = torch.log_softmax(logits, dim=-1)
    chosen = torch.where(greedy[:, None], unscaled, logp).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen
