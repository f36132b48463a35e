"""A simulated newer on-disk format, to test upgrades across a format change for real.

``FORMAT_2`` is a test-only run format 2 in which the group record has schema version 2
(its content is unchanged: what matters is that a reader of format 1 does not read it).
``release(n)`` makes this process a strawq whose newest run format is ``n``: ``release(1)``
is the old strawq (as shipped), ``release(2)`` a new one that knows ``FORMAT_2``. Parts
run in one process by taking turns inside the release they stand for::

    with release(2):
        new_producer.step()     # reads formats 1 and 2; writes the run's format
    with release(1):
        old_collector.step()    # reads format 1 only

``strawq.testing.upgrade`` drives a whole rolling upgrade with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from strawq.ondisk import records
from strawq.ondisk.records import Kind

#: the simulated format: the group record at schema version 2
FORMAT_2: dict[Kind, int] = {Kind.GROUP: 2}


@contextmanager
def release(newest: int) -> Iterator[None]:
    """Within the block, this process reads and writes run formats up to ``newest``
    (1 or 2)."""
    if newest not in (1, 2):
        raise ValueError(f"the simulated releases know formats 1 and 2, not {newest}")
    saved = records._RUN_FORMATS
    table = {1: saved.get(1, {})}
    if newest >= 2:
        table[2] = dict(FORMAT_2)
    records._RUN_FORMATS = table  # one rebinding: a reader thread sees one table or the other
    try:
        yield
    finally:
        records._RUN_FORMATS = saved
