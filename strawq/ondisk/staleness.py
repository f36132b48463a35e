"""Staleness, the one definition (numpy-free, so reading a run's state needs no numpy)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np

_V = TypeVar("_V", int, "np.ndarray")


def staleness(current_version: int, min_version: _V) -> _V:
    """Staleness (docs/design.md, invariant 5): ``current_version`` − the minimum weight version
    over tokens.

    The one definition. What "the tokens" are is the caller's ``min_version``: a group's
    minimum over all its samples' tokens (``TaskName.version`` of a ready group, the
    ``min_version`` of its summary) gives the group's staleness, which orders ready groups
    and is checked against the η bound; an array of per-sample minima (the reader's
    ``sample_min_version``) gives per-sample staleness for the ``staleness/*`` metrics.
    Not clamped: a negative value means the batch was read before the version that stamped
    its tokens was announced.
    """
    return current_version - min_version
