"""Token-level importance sampling helpers: ratios, TIS, IcePop, off-policy prefix mask."""

from __future__ import annotations

import math

import pytest
import torch

from strawq.collector.importance import (
    icepop_mask,
    importance_ratios,
    masked_tis_weights,
    offpolicy_prefix_mask,
    truncated_is,
)


def test_ratios_tis_icepop():
    new = torch.tensor([0.0, -0.5, math.log(3.0), -50.0, 0.0])
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, math.log(0.1)])
    r = importance_ratios(new, old)
    assert torch.allclose(r[:3], torch.tensor([1.0, math.exp(-0.5), 3.0]), rtol=1e-5)
    assert torch.isfinite(r).all() and r[3] > 0  # clamped, no underflow to nan
    assert torch.allclose(truncated_is(r), torch.minimum(r, torch.tensor(2.0)))
    assert icepop_mask(r).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # 10.0 > 5, ~0 < 0.5
    mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.uint8)
    w = masked_tis_weights(new, old, mask, mode="icepop")
    assert w[2] == 0 and w[4] == 0 and torch.isclose(w[1], r[1])
    assert masked_tis_weights(new, old, mask)[4] == 2.0
    with pytest.raises(ValueError, match="expected equal"):
        importance_ratios(new, old[:2])
    with pytest.raises(ValueError, match="mode"):
        masked_tis_weights(new, old, mask, mode="nope")


def test_tis_has_no_gradient_through_the_weight():
    new = torch.tensor([0.1, 0.2], requires_grad=True)
    w = truncated_is(importance_ratios(new, torch.zeros(2)))
    assert not w.requires_grad


def test_offpolicy_prefix_mask():
    versions = torch.tensor([-1, -1, 3, 3, 4, 5], dtype=torch.int64)
    assert offpolicy_prefix_mask(versions, 4).tolist() == [0, 0, 0, 0, 1, 1]
