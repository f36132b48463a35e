from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strawq.producers.budget import split_budget
from strawq.errors import ConfigError


def test_divmod_split_first_producers_get_the_remainder() -> None:
    b = split_budget(concurrency=10, engines=3, group_size=4, producers=4)  # K = 7
    assert b.slots == (2, 2, 2, 1)
    assert b.total == 7
    assert b.trajectory_slots(0) == 8


def test_refuses_too_little_concurrency_with_the_numbers() -> None:
    with pytest.raises(ConfigError) as e:
        split_budget(concurrency=4, engines=1, group_size=8, producers=2)
    msg = str(e.value)
    assert "4*1 = 4" in msg and "2*8 = 16" in msg


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_rejects_non_positive(bad: object) -> None:
    with pytest.raises(ConfigError):
        split_budget(concurrency=bad, engines=1, group_size=1, producers=1)  # type: ignore[arg-type]


@given(st.integers(1, 512), st.integers(1, 64), st.integers(1, 16), st.integers(1, 32))
def test_budget_properties(c: int, e: int, g: int, w: int) -> None:
    if c * e < w * g:
        with pytest.raises(ConfigError):
            split_budget(c, e, g, w)
        return
    b = split_budget(c, e, g, w)
    assert b.total == c * e // g
    assert max(b.slots) - min(b.slots) <= 1
    assert min(b.slots) >= 1
    assert list(b.slots) == sorted(b.slots, reverse=True)
    assert b.total * g <= c * e
