"""Numbered names: ``<prefix><n>``, zero-padded, optionally followed by ``<sep><tail>``.

Most records of a run are named by a number (``batches/<seq>``, ``collector/epoch-<E>``,
``history/seg-<seq>``, ``cursor/<seq>/<seq>.<next>``...): zero-padded so that a sorted
listing is in number order, parsed back from the listing, the newest one wins, older ones
are pruned. This module is the one place those mechanics live, so every family formats,
parses and orders its names the same way. It does not own any family: each family is
declared (``MANIFESTS = Numbered()``) by the module that owns its keys (``tests/test_keys.py``
``OWNERS``), which still says where the names live and what they mean.

Parsing never raises on a name that is not of the family (a temporary file, a stray or
hand-made name): ``parse`` returns None and the listing helpers skip it. Any number of
ASCII digits is read back (``"²".isdigit()`` is true, yet no ``int``), so a name written
with another width still reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import overload


def _decimal(text: str) -> bool:
    """ASCII digits only (a non-empty run of 0-9)."""
    return text.isascii() and text.isdigit()


@dataclass(frozen=True)
class Numbered:
    """A family of names ``<prefix><n>`` with ``n`` zero-padded to ``width`` digits.

    With ``sep``, a name may go on with ``<sep><tail>``: free text (``ack-<v>~<producer>``,
    ``r-<seq>.<nonce>``) or a second number zero-padded to ``tail_width``
    (``<seq>~<version>``, ``hb-<E>~<counter>``: ``pair``, ``pairs``).
    """

    prefix: str = ""
    width: int = 12
    sep: str = ""
    tail_width: int = 12

    def __post_init__(self) -> None:
        if self.width < 1 or self.tail_width < 1:
            raise ValueError(f"widths are >= 1, got {self.width} and {self.tail_width}")
        if any(c.isdigit() for c in self.sep):
            raise ValueError(f"a separator of digits ({self.sep!r}) cannot be parsed back")

    # -- building ------------------------------------------------------------------------------
    def name(self, n: int, tail: int | str = "") -> str:
        """``<prefix><n>``, or ``<prefix><n><sep><tail>`` for a non-empty ``tail`` (an int
        tail is zero-padded to ``tail_width``)."""
        if n < 0:
            raise ValueError(f"{self.prefix or 'a numbered name'}: {n} < 0 cannot be parsed back")
        head = f"{self.prefix}{n:0{self.width}d}"
        if isinstance(tail, int):
            if tail < 0:
                raise ValueError(f"{self.prefix or 'a numbered name'}: tail {tail} < 0")
            tail = f"{tail:0{self.tail_width}d}"
        if not tail:
            return head
        if not self.sep:
            raise ValueError(f"{self.prefix or 'a numbered name'}: no separator for tail {tail!r}")
        return f"{head}{self.sep}{tail}"

    # -- reading one name ----------------------------------------------------------------------
    def split(self, name: str) -> tuple[int, str] | None:
        """(number, tail) of a name of this family (tail ``""`` when there is none), None
        for any other name."""
        if not name.startswith(self.prefix):
            return None
        rest = name[len(self.prefix):]
        digits, _, tail = rest.partition(self.sep) if self.sep else (rest, "", "")
        return (int(digits), tail) if _decimal(digits) else None

    def parse(self, name: str) -> int | None:
        """The number of a name of this family, None for any other name."""
        got = self.split(name)
        return None if got is None else got[0]

    def pair(self, name: str) -> tuple[int, int] | None:
        """(number, tail number) of ``<prefix><n><sep><m>``, None for any other name."""
        got = self.split(name)
        if got is None or not self.sep or not _decimal(got[1]):
            return None
        return got[0], int(got[1])

    # -- reading a listing ---------------------------------------------------------------------
    def named(self, names: Iterable[str]) -> list[tuple[int, str]]:
        """(number, name) of the names of this family, in number order."""
        return sorted((n, name) for name in names if (n := self.parse(name)) is not None)

    def numbers(self, names: Iterable[str]) -> list[int]:
        """The numbers of the names of this family, in order."""
        return [n for n, _ in self.named(names)]

    def pairs(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """(number, tail number) of the names ``<prefix><n><sep><m>``, in order."""
        return sorted(p for name in names if (p := self.pair(name)) is not None)

    @overload
    def newest(self, names: Iterable[str]) -> int | None: ...

    @overload
    def newest(self, names: Iterable[str], default: int) -> int: ...

    def newest(self, names: Iterable[str], default: int | None = None) -> int | None:
        """The highest number of the family in ``names`` (``default`` when none is)."""
        return max((n for name in names if (n := self.parse(name)) is not None),
                   default=default)

    def below(self, names: Iterable[str], n: int) -> list[str]:
        """The names of this family numbered below ``n`` (the ones a newer mark replaced)."""
        return [name for m, name in self.named(names) if m < n]

    def prune(self, names: Iterable[str], keep: int) -> list[str]:
        """The names to delete to keep the newest ``keep`` numbers of the family."""
        if keep < 0:
            raise ValueError(f"keep is >= 0, got {keep}")
        named = self.named(names)
        kept = set(sorted({n for n, _ in named})[-keep:]) if keep else set()
        return [name for n, name in named if n not in kept]
