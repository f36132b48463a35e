"""Producer incarnations: each producer process under an id gets its own number.

Records in ``incarnations/`` (the name is the claim; the body names the process)::

    <n>~<producer>     incarnation n of producer id <producer>: exclusive create at start,
                       body ``strawq.liveness.identity`` JSON plus its wall time ("at")

An operator may restart a producer under the id it had (``--producer-id``): the new
process is a new *incarnation* of that id. Its number is the newest one plus one, taken by
exclusive create (of two processes starting at once under one id, each gets its own
number). An incarnation is *superseded* once a newer one of its id exists, or its own
record is gone (pruned: only the two newest of an id are kept). The protocol over them
(the new incarnation hands back its predecessor's leases; a superseded one stops) is
``strawq.producers.incarnation``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from strawq.errors import AlreadyExists, StrawqError
from strawq.liveness import identity, parse_identity
from strawq.ondisk.names import validate_id
from strawq.ondisk.numbered import Numbered
from strawq.storage import Storage

DIR = "incarnations"
INCARNATIONS = Numbered(sep="~")
KEEP = 2


def incarnation_key(producer: str, n: int) -> str:
    return f"{DIR}/{INCARNATIONS.name(n, validate_id(producer, 'producer id'))}"


def incarnations_of(names: Iterable[str], producer: str) -> list[int]:
    """The incarnation numbers of ``producer`` in a listing of ``incarnations/``, oldest
    first."""
    out = []
    for name in names:
        got = INCARNATIONS.split(name)
        if got is not None and got[1] == producer:
            out.append(got[0])
    return sorted(out)


def begin_incarnation(storage: Storage, producer: str) -> int:
    """Take the next incarnation number of ``producer`` (exclusive create); returns it. The
    records of incarnations older than the newest ``KEEP`` are deleted."""
    storage.makedirs(DIR)
    body = json.dumps({**identity(), "at": time.time()}, separators=(",", ":")).encode()
    while True:
        known = incarnations_of(storage.list(DIR), producer)
        n = (known[-1] if known else 0) + 1
        try:
            storage.publish(incarnation_key(producer, n), body)
        except AlreadyExists:
            continue  # another process of this id took n first: take the next one
        for old in known:
            if old <= n - KEEP:
                storage.delete(incarnation_key(producer, old))
        return n


def successor(storage: Storage, producer: str, n: int) -> dict[str, Any] | None:
    """Who superseded incarnation ``n`` of ``producer`` (its identity, ``{}`` when
    unreadable), or None while ``n`` is the newest. Two stats while it is."""
    if storage.exists(incarnation_key(producer, n)):
        if not storage.exists(incarnation_key(producer, n + 1)):
            return None
        newer = n + 1
    else:
        known = incarnations_of(storage.list(DIR), producer)
        newer = known[-1] if known and known[-1] > n else n + 1
    try:
        who = parse_identity(storage.read(incarnation_key(producer, newer)))
    except StrawqError:
        who = None
    return {"incarnation": newer, **(who or {})}
