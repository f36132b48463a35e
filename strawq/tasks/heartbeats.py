"""Producer heartbeats: a counter in a file name (``hb/<producer>~<counter>``), moved by one
rename within ``hb/`` per beat (``Storage.rename_within``); the grantor and ``strawq status``
watch it move (``strawq.liveness``, ``strawq.tasks.grantor``). ``RunQueue.heartbeat`` is this
module's ``HeartbeatWriter.beat``.
"""

from __future__ import annotations

from collections.abc import Iterator

from strawq.errors import NotFound
from strawq.liveness import identity_bytes
from strawq.ondisk.names import heartbeat_key, parse_heartbeat_state, validate_id
from strawq.storage import Storage


HB_DIR = "hb"


def _name(key: str) -> str:
    """The file name of ``hb/<name>``."""
    return key[len(HB_DIR) + 1:]


def heartbeat_states(storage: Storage) -> Iterator[tuple[str, int, bool]]:
    """(producer, counter, idle) of every heartbeat file."""
    for n in storage.list(HB_DIR):
        hb = parse_heartbeat_state(n)
        if hb is not None:
            yield hb


class HeartbeatWriter:
    """The heartbeats this process writes, each producer's last counter remembered."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._counter: dict[str, int] = {}
        self._idle: dict[str, bool] = {}

    def beat(self, producer: str, *, idle: bool = False) -> int:
        """Advance the producer's heartbeat counter; the grantor watches it move. ``idle``:
        the producer holds no lease and claims nothing until its next non-idle beat, so a
        weight-update bracket need not wait for its ack (``heartbeat_key``)."""
        validate_id(producer, "producer id")
        prev = self._counter.get(producer)
        first = prev is None
        was_idle = self._idle.get(producer, False)
        if prev is None:
            prev, was_idle = max(((c, i) for p, c, i in heartbeat_states(self.storage)
                                  if p == producer), default=(0, False))
        counter = prev + 1
        if prev and not first:
            # One rename moves the counter: no new file and no unlink (on a shared mount a
            # beat cost a create, a rename, an unlink and their lookups: most of an idle
            # producer's metadata operations). It names the two files within ``hb/``,
            # which the store holds open: a rename by path made the kernel look up every
            # component of the run's path twice, two thirds of the beat's metadata
            # round trips with no entry cache (docs/protocol.md §5).
            try:
                self.storage.rename_within(HB_DIR, _name(heartbeat_key(producer, prev, was_idle)),
                                           _name(heartbeat_key(producer, counter, idle)))
                self._counter[producer] = counter
                self._idle[producer] = idle
                return counter
            except NotFound:
                pass  # the grantor forgot this producer (or another process beat): anew
        # This process's first beat publishes anew, naming it (``strawq.liveness``): the
        # renames after it keep the body, so a reader on this host can see it is gone.
        self.storage.publish(heartbeat_key(producer, counter, idle), identity_bytes(),
                             sync_dir=False, sync_file=False)
        self._counter[producer] = counter
        self._idle[producer] = idle
        if prev:
            self.storage.delete(heartbeat_key(producer, prev, was_idle))
        return counter
