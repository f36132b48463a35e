"""Rolling weight updates, producer side: load the published version into this producer's
engines in waves, one engine at a time per wave slot.

The trainer publishes version v once (``weights/manifest-<v>``, ``strawq.weights.publish``)
and announces it; nothing is paused. Each producer, on its loop, reads the newest manifest
and, for each of its engines on an older version, claims a slot of v's wave (an exclusive
create; at most ``wave`` engines of the whole fleet load v at once, with no coordinator),
then for that engine only:

1. takes it out of rotation for new requests (``VersionGuard.loading``);
2. ``pause_generation`` in mode ``abort``: its requests come back aborted, each with every
   token it generated (stamped with the old version), and resume at once from their
   prefix on an engine still in rotation (of their own version while one serves and the
   lag allows, else of the run's: ``VersionGuard.route``); mode ``in_place`` would keep
   them on the engine, but SGLang refuses an update with a flushed cache while requests
   are held (docs/protocol.md), and ``retract`` re-queues them inside the engine, which
   then continues them on the new weights after a re-prefill: ``abort`` hands them back
   to the producer, which may resume them on their own version elsewhere;
3. waits until the engine is idle, ``update_weights_from_disk`` with the version label,
   ``continue_generation`` (``EngineControl.push_weights``, the same steps as the
   bracket's push, on one engine);
4. reads the version back (``/model_info``); on the published one, calls ``after_load``
   (the hook for checks after an engine loaded version v) and puts the engine back in
   rotation; releases the slot. An ``after_load`` that raises keeps the engine out of
   rotation (``refused``, and marked stale in the guard and ``engines/``, as the bracket
   mode marks an engine that failed its check) and a later step loads it again.

A load that failed (refused by ``after_load``, an error, another version read back) is
tried again after a backoff: ``RETRY_MIN_S`` (or ``poll_s``, if longer) after the first
failure at that version, doubling to at most ``RETRY_MAX_S``; a newer published version is
tried at once. An engine that keeps loading wrong weights costs a load a minute, not one
per poll.

**Attestation** (``strawq.weights.fingerprint``). A producer's ``after_load`` is
:func:`attestation`: when the trainer published a fingerprint for v (it does so before v's
manifest, so an engine never loads v before it exists), the engine's slices are read back
(off the event loop, on the producer's io executor), the verdict is recorded
(``attested/``), and a mismatch raises: the engine stays out of rotation, serves no token
at v, and is loaded again at the next step. An engine found on v without a passing verdict
at v (a producer restarted after the load, a check that could not be recorded) is loaded
again like one behind. No fingerprint for v: no check, as in the bracket mode.

A version published as a delta against a base (``strawq.weights.delta``) is built once per
producer on its node's local disk (``cache_dir``: the base's files, from this producer's
own build of it or the published full version, plus the delta's), checked against the
manifest's checksum, and that directory is what its engines load. A delta that cannot be
built into exactly its manifest's weights (its base collected or changed, its files
changed) is refused: the engines stay on their versions, and load the next version
published (the next full one at the latest).

The rest of the fleet keeps generating meanwhile. An engine found on a version too old to
serve is out of rotation until it loaded the newest version (the guard's probes; it is pulled
like any other), and so is a new or restarted engine behind the run's version even within the
lag (``VersionGuard.joining``: it joins by loading the newest, in a wave slot like any other;
a step runs while one waits, even when every engine had been settled). While the run's
version was not published (the bracket mode, or a bracket after a rolling update), this does
nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import tempfile
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from strawq.errors import StrawqError
from strawq.producers.engine_client import EngineClient
from strawq.producers.engine_errors import EngineError
from strawq.producers.engine_versions import VersionGuard
from strawq.producers.meter import StatsBook
from strawq.storage.watch import DirProbe
from strawq.tasks.queue import VERSIONS_DIR
from strawq.storage import Storage
from strawq.weights.delta import DeltaRefused, prune
from strawq.weights.fingerprint import READ_TIMEOUT_S, AttestationError, Fingerprints, attest
from strawq.weights.publish import WEIGHTS_DIR, Manifest, WeightStore

log = logging.getLogger(__name__)

#: seconds before an engine whose load failed is tried again at the same version (the first
#: time; doubling after each failure, to at most ``RETRY_MAX_S``)
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
#: seconds before a behind producer's first look for a free wave slot, doubling after each
#: look that found the wave full up to ``WAVE_RETRY_MAX_S`` (each producer its own multiple,
#: 0.5-1.5x, so the fleet's looks spread out; one of its own loads ending looks at once): a
#: look is one listing of ``weights/``. Among many waiting producers a freed slot is still
#: found within a fraction of a second (someone looks); the fleet's looks fall as the wait
#: goes on. A full step (the manifest, the run's version, the verdicts) runs only when
#: ``versions/`` moved, a backoff ran out, nothing is left to wait for, or ``FULL_STEP_S``
#: passed: every 0.1 s poll of 1,250 producers re-reading all of it while a rolling
#: update waits on its wave would be more than one metadata server serves
WAVE_RETRY_S = 0.5
WAVE_RETRY_MAX_S = 16.0
FULL_STEP_S = 30.0

#: ``after_load(url, version)``: called once an engine reports the version it loaded
AfterLoad = Callable[[str, int], Awaitable[None]]


def attestation(storage: Storage, io: Callable[[Callable[[], Any]], Awaitable[Any]], *,
                timeout_s: float = READ_TIMEOUT_S, api_key: str | None = None) -> AfterLoad:
    """The ``after_load`` that checks an engine against the fingerprint of the version it
    loaded (none published: no check), records the verdict and raises
    :class:`AttestationError` on a mismatch (or an engine that cannot be read). Every
    blocking read runs through ``io``."""
    book = Fingerprints(storage)

    async def after_load(url: str, version: int) -> None:
        fp = await io(lambda: book.get(version))
        if fp is None:
            return
        verdict = await io(functools.partial(attest, url, version, fp, timeout_s=timeout_s,
                                             api_key=api_key))
        await io(lambda: book.record(verdict))
        if not verdict.ok:
            raise AttestationError(verdict.describe())
        log.info("%s (after its rolling load, %.2fs)", verdict.describe(), verdict.seconds)

    return after_load


@runtime_checkable
class WeightLoader(Protocol):
    """A client that loads weights into one engine (``EngineControl.push_weights``)."""

    async def push_weights(self, model_path: str, *, weight_version: int,
                           url: str | None = None) -> dict[str, Any]:
        ...


class RollingPull:
    """One producer's engines, brought to the newest published version a wave at a time."""

    def __init__(self, producer_id: str, *, store: WeightStore,
                 client: Callable[[], EngineClient | None], guard: VersionGuard,
                 io: Callable[[Callable[[], Any]], Awaitable[Any]], book: StatsBook,
                 clock: Callable[[], float], poll_s: float,
                 after_load: AfterLoad | None = None, cache_dir: str | None = None) -> None:
        self.producer_id = producer_id
        self.store = store
        self._client = client
        self.guard = guard
        self._io = io
        self.book = book
        self.clock = clock
        self.poll_s = poll_s
        #: the hook after an engine loaded version v (attestation checks hang here)
        self.after_load = after_load
        #: the newest manifest read (None: the run's version was not published)
        self.manifest: Manifest | None = None
        #: engine URL -> its load in progress
        self.pulls: dict[str, asyncio.Task[None]] = {}
        #: engines whose ``after_load`` check raised: out of rotation, loaded again
        self.refused: dict[str, int] = {}
        #: seconds each finished load held its engine out of rotation
        self.pause_s: list[float] = []
        #: version -> the directory its engines load (a delta's: built in ``cache_dir``)
        self._verified: dict[int, str] = {}
        #: where this producer builds delta versions (its node's local disk): a directory
        #: of its own, which producers sharing ``cache_dir`` never touch
        self.cache_dir = os.path.join(cache_dir or tempfile.gettempdir(),
                                      f"strawq-weights-{producer_id}")
        self._refused: set[int] = set()
        #: engine URL -> (version, failed loads at it, clock before which it is not tried)
        self.backoff: dict[str, tuple[int, int, float]] = {}
        #: engine URL -> the version it loaded here and passed ``after_load`` at (a step
        #: that read ``attested/`` before that verdict was written does not load it again)
        self._passed: dict[str, int] = {}
        self._last = -math.inf
        self._step: asyncio.Task[None] | None = None
        #: a stat of ``weights/`` and ``versions/`` between steps: the manifest and the run's
        #: version are read only when one changed (or every ``full_every_s``), or while
        #: engines are behind; a run in the bracket mode costs a producer no listing per
        #: poll, only a read per update
        self._probe = DirProbe(store.storage, (WEIGHTS_DIR, VERSIONS_DIR), full_every_s=30.0,
                               clock=clock)
        #: the manifest version every engine of this producer holds (nothing to pull)
        self._settled: int | None = None
        #: while behind: a look at ``versions/`` alone (a new version announced), the
        #: engines waiting for a wave slot, what makes the next full step due at once (one
        #: of this producer's loads ended), when the next look for a slot is due, and when
        #: the last full step ran (``tick``)
        self._vprobe = DirProbe(store.storage, (VERSIONS_DIR,), full_every_s=math.inf,
                                clock=clock)
        self._waiting: list[str] = []
        self._wake = False
        self._look_at = -math.inf
        self._look_wait = WAVE_RETRY_S
        #: the manifest this step read (``lag_of`` reuses it within the step)
        self._fresh: tuple[Manifest | None] | None = None
        self._full_at = -math.inf
        self._spread = 0.5 + (zlib.crc32(producer_id.encode()) % 1000) / 1000
        guard.lag_reader = self.lag_of

    def lag_of(self, run_version: int) -> int | None:
        """The lag ``run_version`` was published with (None: it was not; blocking I/O)."""
        m = self._fresh[0] if self._fresh is not None else self.store.newest()
        return m.max_lag if m is not None and m.version == run_version else None

    async def start(self) -> None:
        """Delete the wave slots an earlier process of this id held."""
        try:
            gone = await self._io(lambda: self.store.release_mine(self.producer_id))
        except StrawqError as exc:
            log.warning("producer %s cannot read weights/: %s", self.producer_id, exc)
            return
        if gone:
            log.warning("producer %s: released %d wave slots an earlier process of this id "
                        "held", self.producer_id, gone)

    def tick(self) -> None:
        """From the producer's loop: a step every ``poll_s`` (in a task: the loop never
        waits on a load). While this producer is behind, a full step only when something
        it reads may have changed, and between them a look for a free wave slot every
        ``WAVE_RETRY_S`` (its own multiple) for the engines the wave had no slot for."""
        now = self.clock()
        if now - self._last < self.poll_s:
            return
        if self._step is not None and not self._step.done():
            return
        m = self.manifest
        if m is None or self._settled == m.version or self._full_due(now):
            self._last = now
            self._step = asyncio.create_task(self.step())
        elif self._waiting and now >= self._look_at:
            self._last = now
            self._step = asyncio.create_task(self.look_for_slots(m))

    def _full_due(self, now: float) -> bool:
        """Behind: whether a full step is due (see ``tick``)."""
        if self._wake or now - self._full_at >= FULL_STEP_S:
            return True
        if any(v == self.manifest.version and now >= at  # type: ignore[union-attr]
               for v, _n, at in self.backoff.values()):
            return True
        return self._vprobe.changed()

    async def look_for_slots(self, m: Manifest) -> None:
        """Claim a wave slot for each engine that found the wave full, from one listing of
        ``weights/`` (``_claim``)."""
        self._look_at = self.clock() + self._look_wait * self._spread
        self._look_wait = min(2 * self._look_wait, WAVE_RETRY_MAX_S)
        client = self._client()
        if client is None or not isinstance(client, WeightLoader):
            return
        waiting, self._waiting = self._waiting, []
        for i, url in enumerate(waiting):
            if url in self.pulls:
                continue
            slot = await self._claim(m, url)
            if slot is None:
                self._waiting = waiting[i:]
                return
            self._look_wait = WAVE_RETRY_S
            self.pulls[url] = asyncio.create_task(self.pull(client, url, m, slot))

    async def _claim(self, m: Manifest, url: str) -> int | None:
        """A wave slot of ``m`` for ``url``, from the slots' names alone
        (``WeightStore.claim_slot(check_url=False)``: this producer's own loads are in
        ``pulls``, and its predecessor's slots were released at ``start``); None when the
        wave is full or the claim failed (logged): either way looked for again later."""
        try:
            slot: int | None = await self._io(functools.partial(
                self.store.claim_slot, m, self.producer_id, url, check_url=False))
            return slot
        except StrawqError as exc:
            log.warning("producer %s cannot claim a wave slot: %s", self.producer_id, exc)
            return None

    async def step(self) -> None:
        """Read the newest manifest; start a load on each engine behind it while a wave
        slot is free."""
        m = self.manifest
        if (m is None or self._settled == m.version) and not self.guard.joining \
                and not self._probe.changed():
            return
        self._wake = False
        self._full_at = self.clock()
        self._waiting = []
        try:
            m = await self._io(self.store.newest)
            self._fresh = (m,)
            run_v, paused = await self.guard.refresh()  # sets the guard's lag (lag_of)
        except StrawqError as exc:
            self._fresh = None
            log.warning("producer %s cannot read weights/: %s", self.producer_id, exc)
            return
        self._fresh = None
        if m is None or m.version != run_v or paused:
            self.manifest = None  # not published (a bracket): the run's version only
            return
        self.manifest = m
        if not await self._verify(m):
            return
        client = self._client()
        if client is None or not isinstance(client, WeightLoader):
            return
        behind = bool(self.pulls)
        try:  # url -> whether it may serve m.version (no fingerprint: True)
            attested = await self.guard.verdicts(m.version)
        except StrawqError as exc:
            log.warning("producer %s cannot read attested/: %s", self.producer_id, exc)
            return
        for url in list(client.worker_urls):
            if url in self.pulls:
                continue
            v = self.guard.versions.get(url)
            if v is None:
                v = await self.guard.probe(url)
            if v is not None and v >= m.version and url not in self.refused and (
                    v != m.version or self._passed.get(url) == v or attested(url) is True):
                continue
            behind = True
            wait = self.backoff.get(url)
            if wait is not None and wait[0] == m.version and self.clock() < wait[2]:
                continue  # failed at this version: tried again after its backoff
            if self._waiting:
                self._waiting.append(url)  # the wave was full for an engine before it
                continue
            slot = await self._claim(m, url)
            if slot is None:  # the wave is full: looked for again (``look_for_slots``)
                self._waiting.append(url)
                self._look_at = self.clock() + self._look_wait * self._spread
                continue
            self.pulls[url] = asyncio.create_task(self.pull(client, url, m, slot))
        self._settled = None if behind else m.version

    async def _verify(self, m: Manifest) -> bool:
        """Check the published weights against their manifest once per version (a delta:
        build it on the local disk and check what was built)."""
        if m.version in self._verified:
            return True
        if m.version in self._refused:
            return False
        try:
            path = await self._io(functools.partial(self._prepare, m))
        except (DeltaRefused, OSError) as exc:
            self._refused.add(m.version)
            log.error("producer %s: version %d is not loaded: %s", self.producer_id,
                      m.version, exc)
            return False
        self._verified[m.version] = path
        return True

    def _prepare(self, m: Manifest) -> str:
        """Blocking: the directory the engines load ``m`` from, verified."""
        if not m.is_delta:
            self.store.verify(m)
            return m.path
        path = self.store.materialize(m, self.cache_dir)
        prune(self.cache_dir, m.version - 1)  # keeps this build and its base's
        log.info("producer %s: version %d built from version %d and its delta (%.1f of "
                 "%.1f MB) in %s", self.producer_id, m.version, m.base, m.written / 1e6,
                 m.bytes / 1e6, path)
        return path

    async def pull(self, client: WeightLoader, url: str, m: Manifest, slot: int) -> None:
        """Load ``m`` into the engine at ``url`` (holding wave slot ``slot``)."""
        self.guard.loading.add(url)
        t0 = self.clock()
        try:
            await client.push_weights(self._verified.get(m.version, m.path),
                                      weight_version=m.version, url=url)
            v = await self.guard.probe(url)
            if v != m.version:
                raise EngineError(f"engine reports version {v} after loading {m.version}",
                                  url=url)
            if self.after_load is not None:
                try:
                    await self.after_load(url, m.version)
                except Exception as exc:  # noqa: BLE001 - any refusal keeps the engine out
                    self.refused[url] = m.version
                    # out of rotation and noted (engines/) as in the bracket mode: a reply
                    # it might still send at this version is refused (VersionGuard.check)
                    await self.guard.mark(url, m.version, m.version,
                                          f"refused after loading version {m.version}: {exc}")
                    raise EngineError(f"refused after loading version {m.version}: {exc}",
                                      url=url) from exc
            self.refused.pop(url, None)
            self.backoff.pop(url, None)
            self._passed[url] = m.version
            held = self.clock() - t0
            self.pause_s.append(held)
            self.book.bump("rolling_loads")
            self.book.bump("rolling_pause_ms", int(held * 1000))
            log.info("producer %s: engine %s loaded version %d in %.2fs (wave slot %d)",
                     self.producer_id, url, m.version, held, slot)
            await self.guard.loaded(url, m.version)
        except (EngineError, StrawqError) as exc:
            self.book.bump("rolling_load_failures")
            last = self.backoff.get(url)
            n = (last[1] if last is not None and last[0] == m.version else 0) + 1
            delay = min(RETRY_MAX_S, max(RETRY_MIN_S, self.poll_s) * 2 ** (n - 1))
            self.backoff[url] = (m.version, n, self.clock() + delay)
            log.warning("producer %s: engine %s did not load version %d: %s; tried again in "
                        "%.1fs (failure %d at this version)", self.producer_id, url,
                        m.version, exc, delay, n)
        finally:
            if url not in self.refused:
                self.guard.loading.discard(url)  # back in rotation
            self.guard.load_ended(url)
            self.pulls.pop(url, None)
            if self._waiting:  # its slot is free now: an engine waiting looks at once
                self._look_at = -math.inf
                self._look_wait = WAVE_RETRY_S
            else:  # the next tick steps in full (anything left to load, or settled)
                self._wake = True
            try:
                await self._io(lambda: self.store.release_slot(m.version, slot))
            except StrawqError as exc:
                log.warning("producer %s cannot release wave slot %d of version %d: %s",
                            self.producer_id, slot, m.version, exc)

    async def close(self) -> None:
        """Wait for the loads in progress (each ends with its engine continued)."""
        tasks = [t for t in (self._step, *self.pulls.values()) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
