"""Deterministic per-position randomness for the local engines (no torch).

Randomness is a pure function of ``(seed, absolute position)`` (like SGLang's seeded
sampler, which hashes seed and position). A request resumed from its prefix with the same
seed therefore draws the same random numbers it would have drawn without interruption.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_hash(seed: int, position: int) -> int:
    return splitmix64((seed & _MASK64) ^ splitmix64(position))


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) determined by seed and position."""
    return (position_hash(seed, position) >> 11) / float(1 << 53)
