"""Engines on the right weights: a producer's guard against an engine on another version.

Every ``/generate`` reply carries the engine's ``meta_info.weight_version`` (and per-token
``weight_versions``); the run's version is durable in the queue (``versions/``). Outside a
weight-update bracket every engine must hold the run's version, so a reply from another
version means the engine is on the wrong weights: restarted from an old checkpoint, missed
by a push that failed, or a new worker behind the router. :class:`VersionGuard` then

* **discards the reply** (:class:`StaleEngine`): its tokens are never applied to the
  sample, so none is stamped, stored or trained as the run's version; the runner re-issues
  the request at once, on an engine still in rotation (the tokens are counted in
  ``stale_tokens_discarded``);
* **takes the engine out of rotation** for new requests (:class:`GuardedClient` sends
  each request only among the engines in rotation), and
* **writes a note** under ``engines/`` (``strawq.weights.engine_weights``) that the trainer's side
  reads (``WeightUpdateBracket.engines_needing_weights``) to push the run's weights to it
  through its ordinary push path.

A stale engine is probed (``/model_info`` ``weight_version``) every ``probe_s``; once it
reports the run's version it is back in rotation and every note on it up to that version is
deleted, this producer's or not. At start and after each bracket resumes, every engine is
probed: one the push missed is found before any request goes to it, and the notes on the
engines found on the run's version are deleted (a producer that died after noting an
engine leaves a note that the next probe clears, ``EngineWeights.clear_fixed``). Each
engine probed is registered once in ``engine-urls/``, for ``strawq bracket status``.

**When a mismatch is real.** During a bracket versions legitimately differ (engines are
updated one by one; a reply may carry tokens of two versions). A mismatch is judged only
after re-reading the run's version and ``control/``: while a pause is open or seen, replies
keep the engine's own per-token stamps (as the bracket's parking always did) and nothing is
marked. Outside a bracket a reply with any token of another version is discarded (those
tokens were generated on weights that were not the run's); its engine is marked unless a
probe shows it holds the run's version now (a reply built on the run's version, or a
producer that slept through a bracket and gets its old replies back).

**Behind a router** the reply does not say which worker answered: a mismatch triggers a
re-read of the router's ``/workers`` and a probe of each one; those on another version are
noted for the trainer, but the router keeps routing to them until they are repaired, so
some replies are discarded and re-issued meanwhile (``stale_replies``). When every engine
is stale, producers claim nothing and generate nothing (``waiting_for_weights``, one log
line) until one is back.

**Attestation** (``strawq.weights.fingerprint``). A label is what the pusher declared, not
what the engine loaded. When the trainer published a fingerprint for the run's version, an
engine is on that version only if it reports it *and* its newest check (``attested/``) at
it passed: a probe that finds it failed or unchecked marks it (reason "failed attestation"
/ "not attested") and it stays out until a repair push passes the check; a reply on the
run's version from an engine marked out or failed is refused like a stale one (its tokens
are never applied: ``attestation_refused_replies``, ``attestation_refused_tokens``).

**Rolling weight updates** (``strawq.producers.rolling``): when the run's version was
published for engines to pull (``weights/manifest-<v>``), an engine may lag it by the
manifest's ``max_lag`` versions and still serve (``lag``): a reply whose every token is of a
version in ``[run - lag, run]`` is applied with its exact per-token stamps. The guard keeps
each engine's version as last seen (``versions``); an engine loading new weights is out of
rotation (``loading``) until it reports them. The lag is for engines already in rotation: a
new engine (first probed by this producer) or a restarted one (its version went back, seen by
a probe or by a reply older than the engine's version with no load of it since the request
was sent) behind the run's version is out of rotation (``joining``) until its producer loaded
the newest into it, and every reply of it meanwhile is discarded like a stale one. A
partial resumes on an engine of its own newest token's version while one is in rotation and
within the lag, else on an engine of the run's version (``route``; the sample step says what
it resumes, ``resuming``).

**Every client is guarded.** A producer wraps whatever engine client it is given (built
from its config or injected) in a :class:`GuardedClient`: each ``generate`` goes only to
engines in rotation and its reply is judged before the sample step sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableSet, Sequence
from typing import Any

import numpy as np

from strawq.errors import StrawqError
from strawq.producers.engine_client import EngineClient, optional_calls, takes_chunks
from strawq.producers.engine_errors import EngineError
from strawq.producers.meter import StatsBook
from strawq.producers.sglang_protocol import GenerateResult
from strawq.weights.control import read_state
from strawq.weights.engine_weights import EngineProbe, EngineWeights
from strawq.weights.fingerprint import Fingerprints

log = logging.getLogger(__name__)


#: the segment being generated resumes a prefix: (its newest token's version, its tokens,
#: its oldest token's version)
RESUMING: contextvars.ContextVar[tuple[int, int, int] | None] = contextvars.ContextVar(
    "strawq_resuming", default=None)


#: the group of the segment being generated was loaded at this run version (a fresh
#: segment's tokens must be no older: the collector's bound on a fresh group)
BORN: contextvars.ContextVar[int | None] = contextvars.ContextVar("strawq_born", default=None)


@contextlib.contextmanager
def born_at(version: int | None) -> Iterator[None]:
    """Within it, a fresh segment (no prefix) belongs to a group whose load read the run's
    ``version``: in the rolling mode a reply with an older token is refused."""
    token = BORN.set(None if version is None else int(version))
    try:
        yield
    finally:
        BORN.reset(token)


@contextlib.contextmanager
def resuming(versions: Sequence[int] | np.ndarray) -> Iterator[None]:
    """Within it, a ``generate`` resumes a prefix whose per-token versions are ``versions``
    (routing by version, ``VersionGuard.route``); nothing for an empty prefix."""
    token = RESUMING.set((int(versions[-1]), len(versions), int(min(versions)))
                         if len(versions) else None)
    try:
        yield
    finally:
        RESUMING.reset(token)


class StaleEngine(EngineError):
    """A reply from weights other than the run's version: discarded; re-issue elsewhere."""

    def __init__(self, message: str, *, url: str | None, engine_version: int,
                 run_version: int, tokens: int) -> None:
        super().__init__(message, url=url)
        self.engine_version = engine_version
        self.run_version = run_version
        self.tokens = tokens


class NoFreshEngine(EngineError):
    """Every engine is out of rotation (on weights other than the run's version)."""


class VersionWindow:
    """Which engine versions may serve, and where a resumed segment goes (rolling weight
    updates, ``strawq.producers.rolling``); the bracket mode's window is the run's version
    alone. Part of :class:`VersionGuard`."""

    #: the run's version as last read (None: not read yet)
    expected: int | None

    def __init__(self) -> None:
        #: rolling updates: versions an engine may lag the run's (None: none, the bracket)
        self.lag: int | None = None
        #: engine URL -> the weight version it last reported (a reply or a probe)
        self.versions: dict[str, int] = {}
        #: engines loading new weights now: out of rotation (``strawq.producers.rolling``)
        self.loading: set[str] = set()
        #: engines new to this producer (first seen) or restarted (their version went
        #: back) on a version older than the run's published one: out of rotation until
        #: they loaded the newest (``joins``; ``loaded`` puts them back)
        self.joining: set[str] = set()
        #: loads ended so far, and the count at each engine's last one (``load_ended``): a
        #: reply sent before its engine's load may carry the version it had before
        self.loads_ended = 0
        self._ended_at: dict[str, int] = {}
        #: reads the lag the run's version was published with (None: not published), off
        #: the event loop at each ``refresh``: a reply from an engine not yet updated to a
        #: version published a moment ago is judged by it, not as a stale engine's
        self.lag_reader: Callable[[int], int | None] | None = None
        #: the collector's η as last read (None: unbounded, or none published)
        self.eta: int | None = None
        #: reads it (``RunQueue.eta_policy``), off the event loop at each ``refresh``
        self.eta_reader: Callable[[], int | None] | None = None

    def saw_version(self, version: int) -> None:
        """The run's version as a group load read it (at or after the group's release):
        routing never goes by an older view of the run than the newest seen."""
        if self.expected is None or int(version) > self.expected:
            self.expected = int(version)

    def joins(self, url: str, version: int, before: int | None) -> bool:
        """Rolling: whether ``url``, found on ``version`` and last seen on ``before`` (None:
        never), is a new or restarted engine behind the run's version, which then joins
        ``joining`` (out of rotation until it loaded the newest). Found on the run's
        version (or outside the rolling mode) it leaves ``joining``."""
        if self.lag is None or self.expected is None or version >= self.expected:
            self.joining.discard(url)
            return False
        if url in self.joining:
            return True
        if before is not None and version >= before:
            return False  # in rotation before, lagging within the lag: serves as it was
        self.joining.add(url)
        log.warning("engine %s is %s on version %d, behind the run's published version %d: "
                    "out of rotation until it loaded it", url,
                    "new" if before is None else f"restarted (it was on {before})", version,
                    self.expected)
        return True

    def load_ended(self, url: str) -> None:
        """A load into ``url`` ended (loaded or not): a reply sent before it may carry the
        version ``url`` had before."""
        self.loads_ended += 1
        self._ended_at[url] = self.loads_ended

    def fits(self, version: int, run_version: int | None = None) -> bool:
        """Whether an engine on ``version`` may serve: the run's version, or (rolling) at
        most ``lag`` versions behind it."""
        run_v = self.expected if run_version is None else run_version
        if run_v is None:
            return False
        lo = run_v - (self.lag or 0)
        return lo <= int(version) <= run_v

    def route(self, urls: list[str]) -> list[str]:
        """Rolling: the engines a segment should go to among ``urls``. A resumed one: those
        of its prefix's newest version while that version may serve and η allows, else
        those of the run's version, else all. A fresh one (no prefix): those of the run's
        version; while none is in rotation (the first wave still loading), those whose
        tokens η allows, else none (:class:`NoFreshEngine`: it waits). ``urls`` otherwise
        (the bracket).

        "η allows" a version u when a token of u trained a version from now is within η
        (``u + η > run``; always without a known η). A resumed segment goes back to its
        own version only while its *oldest* token passes: a lagging engine is one its
        producer will load the new version into soon (its wave), which aborts what runs
        there, and a due partial sent to it was parked again, and again, past its deadline.
        A fresh segment on a lagging engine starts a group with tokens older than its
        release: under η = 1 such a group is due before it can finish. Both were trained
        over η under ``eta_mode="hard"`` (the lab's ``stream+rolling``: 21 groups in 4
        steps, staleness up to 3)."""
        pref = RESUMING.get()
        if self.lag is None or self.expected is None:
            return urls
        run, eta = self.expected, self.eta

        def allows(version: int) -> bool:
            return eta is None or version + eta > run

        if pref is not None and self.fits(pref[0]) and allows(pref[2]):
            same = [u for u in urls if self.versions.get(u) == pref[0]]
            if same:
                return same
        newest = [u for u in urls if self.versions.get(u) == run]
        if newest or pref is not None:
            return newest or urls
        ok = [u for u in urls if (v := self.versions.get(u)) is None or allows(v)]
        if urls and not ok:
            raise NoFreshEngine(f"no engine of the run's version {run} in rotation yet, and "
                                f"η = {eta} allows no fresh group on an older one: waiting "
                                "for the first wave's load")
        return ok

    def _fits_all(self, weight_version: int, versions: np.ndarray) -> bool:
        return self.fits(weight_version) and (
            not len(versions) or (self.fits(int(versions.min()))
                                  and self.fits(int(versions.max()))))


class VersionGuard(VersionWindow):
    """One producer's view of which engines hold the run's weights."""

    def __init__(self, producer_id: str, *, client: Callable[[], EngineClient | None],
                 current_version: Callable[[], int], notes: EngineWeights,
                 io: Callable[[Callable[[], Any]], Awaitable[Any]],
                 pausing: Callable[[], bool], book: StatsBook,
                 probe_s: float = 0.5, probe_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.producer_id = producer_id
        self._client = client
        self._current_version = current_version
        self.notes = notes
        self._io = io
        self._pausing = pausing
        self.book = book
        self.probe_s = probe_s
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        #: the run's version as last read (None: not read yet)
        self.expected: int | None = None
        #: engine URL -> the version it reported (None: unreadable) while out of rotation
        self.stale: dict[str, int | None] = {}
        self.waiting = False
        self._last_probe = -float("inf")
        self._probing: asyncio.Task[None] | None = None
        #: engine URLs registered in engine-urls/ by this producer
        self._registered: set[str] = set()
        #: the trainer's fingerprints and its verdicts on the engines (``attested/``)
        self.attestations = Fingerprints(notes.storage)
        VersionWindow.__init__(self)

    def check_born(self, result: GenerateResult) -> None:
        """Rolling, with a known η: refuse a fresh segment's reply with a token η does not
        allow against its group's load (``oldest + η <= loaded``; an engine that lagged
        while the route's view of the run was older): applied, it would start a group due
        before it could finish. Counted in ``stale_replies`` and
        ``stale_tokens_discarded``; the engine is not marked (it may serve prefixes)."""
        born = BORN.get()
        if self.lag is None or born is None or self.eta is None:
            return
        versions = np.asarray(result.versions)
        oldest = int(versions.min()) if len(versions) else int(result.weight_version)
        if oldest + self.eta > born:  # as ``route`` allows: trained a version on, within η
            return
        raise self._discarded(
            result, f"starts a group loaded at version {born} with tokens of version {oldest} "
            "(a lagging engine)", "the request goes to an engine of the run's version", born)

    # -- rotation (the client asks) ---------------------------------------------------------
    def serves(self, url: str) -> bool:
        return url not in self.stale and url not in self.loading and url not in self.joining

    def usable(self, urls: list[str]) -> list[str]:
        """``urls`` still in rotation; :class:`NoFreshEngine` when none is."""
        ok = [u for u in urls if self.serves(u)]
        if urls and not ok:
            self._set_waiting(True)
            raise NoFreshEngine(
                f"every engine is on weights other than the run's version {self.expected}: "
                f"{self._describe()}; waiting for the trainer to push them")
        return ok

    def all_stale(self) -> bool:
        urls = self._worker_urls()
        return bool(urls) and all(u in self.stale for u in urls)

    # -- judging a reply (the client calls it before applying any token) --------------------
    def fresh(self, result: GenerateResult) -> bool:
        """True when every token of ``result`` is of the version the guard expects (no
        I/O: what a streamed chunk needs before the producer holds its tokens)."""
        versions = np.asarray(result.versions)
        exp = self.expected
        return exp is not None and result.weight_version == exp and (
            not len(versions) or int(versions.min()) == exp == int(versions.max()))

    async def check(self, result: GenerateResult, *, sent: int | None = None) -> None:
        """Return when ``result`` may be applied; raise :class:`StaleEngine` when its tokens
        come from weights other than the run's version outside a bracket, or (rolling) from
        an engine that restarted on an older version than it had (``sent``: the count of
        loads ended when the request was sent, ``loads_ended``)."""
        versions = np.asarray(result.versions)
        if result.url is not None:
            before = self.versions.get(result.url)
            self.versions[result.url] = int(result.weight_version)
            if sent is not None and (result.url in self.joining or (
                    before is not None and result.weight_version < before)):
                self._check_restarted(result, before, sent)
        exp = self.expected
        if exp is not None and result.weight_version == exp and result.url not in self.stale \
                and (not len(versions) or (int(versions.min()) == exp == int(versions.max()))):
            return
        if self._fits_all(result.weight_version, versions) and (
                exp is None or result.weight_version != exp):
            return
        run_v, paused = await self.refresh()
        if paused or self._pausing():
            return  # a bracket is open: versions legitimately differ; stamps stay honest
        n = len(result.output_ids)
        if result.weight_version == run_v and (
                not len(versions) or bool((versions == run_v).all())):
            await self._check_attested(result, run_v, n)
            return
        if self._fits_all(result.weight_version, versions):
            return
        self.book.bump("stale_replies")
        self.book.bump("stale_tokens_discarded", n)
        found = sorted({int(v) for v in versions.tolist()} | {result.weight_version})
        if result.weight_version != run_v:
            if self._router_url() is not None and result.url == self._router_url():
                await self.probe_all(refresh_workers=True)
            elif result.url is not None:
                # marked unless it holds the run's version now (a producer that slept
                # through a bracket sees its old replies come back: the engine is fine)
                now = await self._probe(result.url)
                if now != run_v:
                    await self.mark(result.url, result.weight_version if now is None else now,
                                    run_v, f"replied with version {result.weight_version}")
        raise StaleEngine(
            f"reply {result.rid} carries weight version(s) {found} but the run is at version "
            f"{run_v}: its {n} tokens are discarded and the request goes to another engine",
            url=result.url, engine_version=result.weight_version, run_version=run_v, tokens=n)

    def _check_restarted(self, result: GenerateResult, before: int | None, sent: int) -> None:
        """Rolling: a reply on an older version than its engine had, with no load of that
        engine since the request was sent (an aborted reply of a load carries the version
        before it): the engine restarted. It joins ``joining`` and the reply is discarded
        (its tokens, of a version older than the engine served, would follow newer ones),
        as is every reply of an engine in ``joining`` behind the run's version (one sent
        before it was found, or aborted by its load)."""
        url = result.url
        if url is None or (self._router_url() is not None and url == self._router_url()) \
                or not self._loads():
            return
        if url not in self.joining and (url in self.loading or self._ended_at.get(url, 0) > sent):
            return  # a lagging engine's reply aborted by its load: its version before it
        if not self.joins(url, int(result.weight_version), before):
            return
        raise self._discarded(
            result, f"from {url}, a restarted or new engine on version {result.weight_version} "
            f"(it was on {before})", "the request goes to another engine; the engine loads "
            "the newest version before it serves", self.expected or 0)

    def _discarded(self, result: GenerateResult, what: str, then: str,
                   run_version: int) -> StaleEngine:
        """Count ``result`` discarded as stale; the error that sends its request elsewhere."""
        n = len(result.output_ids)
        self.book.bump("stale_replies")
        self.book.bump("stale_tokens_discarded", n)
        return StaleEngine(f"reply {result.rid} {what}: its {n} tokens are discarded and {then}",
                           url=result.url, engine_version=result.weight_version,
                           run_version=run_version, tokens=n)

    async def _check_attested(self, result: GenerateResult, run_v: int, n: int) -> None:
        """A reply on the run's version from an engine that failed attestation (or has no
        verdict at a version with a fingerprint) is refused like a stale one: its tokens
        came from weights other than the ones the version names."""
        url = result.url
        if url is None or (self._router_url() is not None and url == self._router_url()):
            return  # behind a router: the workers' probes judge (probe_all)
        verdict = await self._io(lambda: self.attestations.attested(url, run_v))
        if verdict is True:
            return
        self.book.bump("attestation_refused_replies")
        self.book.bump("attestation_refused_tokens", n)
        why = "failed attestation" if verdict is False else "not attested"
        await self.mark(url, run_v, run_v, f"{why} at version {run_v}")
        raise StaleEngine(
            f"reply {result.rid} from {url}, which {why} at version {run_v} (its weights "
            f"are not the ones version {run_v} names): its {n} tokens are refused and the "
            "request goes to another engine",
            url=url, engine_version=run_v, run_version=run_v, tokens=n)

    async def verdicts(self, run_v: int) -> Callable[[str], bool | None]:
        """url -> whether it may serve ``run_v`` (``Fingerprints.attested``), read once, for
        this producer's engines (its workers and the ones out of rotation) only."""
        mine = set(self._worker_urls()) | set(self.stale)

        def read() -> tuple[bool, dict[str, bool]]:
            has = self.attestations.get(run_v) is not None
            return has, ({u: v.ok for u, v in self.attestations.verdicts(run_v, mine).items()}
                         if has else {})
        has, found = await self._io(read)
        return lambda url: True if not has else found.get(url.rstrip("/"))

    async def refresh(self) -> tuple[int, bool]:
        """Re-read the run's version and whether a bracket is open (off the event loop)."""
        def read() -> tuple[int, bool, int | None, int | None]:
            v = self._current_version()
            lag = self.lag if self.lag_reader is None else self.lag_reader(v)
            eta = self.eta if self.eta_reader is None else self.eta_reader()
            return v, read_state(self.notes.storage).paused, lag, eta
        run_v, paused, lag, eta = await self._io(read)
        self.expected = int(run_v)
        self.lag = lag
        self.eta = eta
        return self.expected, bool(paused)

    # -- marking and restoring --------------------------------------------------------------
    async def mark(self, url: str, engine_version: int | None, run_version: int,
                   reason: str) -> None:
        """Take ``url`` out of rotation and note it for the trainer (once per episode)."""
        if url in self.stale:
            self.stale[url] = engine_version
            return
        self.stale[url] = engine_version
        self.book.bump("engines_marked_stale")
        log.error("producer %s: engine %s is on weight version %s but the run is at %d (%s); "
                  "out of rotation until the trainer pushes version %d to it (noted in "
                  "engines/)", self.producer_id, url, engine_version, run_version, reason,
                  run_version)
        try:
            await self._io(lambda: self.notes.mark(
                url, writer=self.producer_id, engine_version=engine_version,
                run_version=run_version, reason=reason))
        except StrawqError as exc:
            log.warning("producer %s cannot note engine %s in engines/: %s", self.producer_id,
                        url, exc)

    async def restore(self, url: str, run_version: int) -> None:
        if self.stale.pop(url, "absent") == "absent":
            return
        self.book.bump("engines_restored")
        log.warning("producer %s: engine %s reports the run's version %d again; back in "
                    "rotation", self.producer_id, url, run_version)
        if not self.all_stale():
            self._set_waiting(False)
        try:  # every note on it up to this version: a dead writer's too
            await self._io(lambda: self.notes.clear(url, up_to_version=run_version))
        except StrawqError as exc:
            log.warning("producer %s cannot clear the engines/ notes on %s: %s",
                        self.producer_id, url, exc)

    # -- probing ----------------------------------------------------------------------------
    async def probe_all(self, *, refresh_workers: bool = False) -> None:
        """Probe every engine's version (at start, after a bracket resumed, and behind a
        router on a mismatch); mark those off the run's version, restore the others."""
        run_v, paused = await self.refresh()
        if paused or self._pausing():
            return
        router = optional_calls(self._client()).router
        if refresh_workers and router is not None and router.router_url is not None:
            try:
                await asyncio.wait_for(router.refresh_workers(), self.probe_timeout_s)
            except (EngineError, asyncio.TimeoutError) as exc:
                log.warning("producer %s cannot re-read the router's workers: %s",
                            self.producer_id, exc)
        urls = self._worker_urls()
        await self._register(urls)
        found = await asyncio.gather(*(self._probe(u) for u in urls))
        attested = await self.verdicts(run_v)
        fine: dict[str, EngineProbe] = {}
        for url, v in zip(urls, found, strict=True):
            if v is None:
                continue  # unreachable: the generate path's own retries deal with it
            self._seen(url, v)
            if v != run_v and not self.fits(v, run_v):
                await self.mark(url, v, run_v, f"reports version {v}")
            elif v == run_v and (ok := attested(url)) is not True:
                await self.mark(url, v, run_v, ("failed attestation" if ok is False else
                                                "not attested") + f" at version {v}")
            else:
                if v == run_v:
                    fine[url.rstrip("/")] = EngineProbe(url, v)
                await self.restore(url, run_v)
        if fine:
            try:  # notes on engines found fine, whoever wrote them (a dead producer)
                await self._io(lambda: self.notes.clear_fixed(run_v, fine))
            except StrawqError as exc:
                log.warning("producer %s cannot clear engines/ notes: %s", self.producer_id,
                            exc)
        self._last_probe = self.clock()

    async def reachable(self) -> bool:
        """Whether the generate path answers at all: behind a router, the router lists a
        healthy worker; else some worker answers its version probe (any version)."""
        calls = optional_calls(self._client())
        if calls.router is not None and calls.router.router_url is not None:
            try:
                workers = await asyncio.wait_for(calls.router.refresh_workers(),
                                                 self.probe_timeout_s)
            except (EngineError, asyncio.TimeoutError) as exc:
                log.debug("router probe failed: %s", exc)
                return False
            return any(w.is_healthy for w in workers)
        urls = self._worker_urls()
        if not urls or calls.version is None:
            return True  # nothing to probe with: the generate path's retries judge
        found = await asyncio.gather(*(self._probe(u) for u in urls))
        return any(v is not None for v in found)

    async def _register(self, urls: list[str]) -> None:
        """Register the engines not yet registered by this producer (``engine-urls/``)."""
        new = [u for u in urls if u not in self._registered]
        if not new:
            return

        def write() -> None:
            for u in new:
                self.notes.register(u)
        try:
            await self._io(write)
            self._registered.update(new)
        except StrawqError as exc:
            log.warning("producer %s cannot register its engines in engine-urls/: %s",
                        self.producer_id, exc)

    async def probe_stale(self) -> None:
        run_v, paused = await self.refresh()
        if paused or self._pausing():
            return
        attested = await self.verdicts(run_v)
        for url in list(self.stale):
            v = await self._probe(url)
            if v is not None:
                self._seen(url, v)
            if v is not None and self.fits(v, run_v) and (v != run_v or attested(url) is True):
                await self.restore(url, run_v)
            elif v is not None:
                self.stale[url] = v
        self._last_probe = self.clock()

    def tick(self) -> None:
        """From the producer's loop: probe the stale engines every ``probe_s`` (in a task,
        so a slow engine never stalls the loop)."""
        if not self.stale or self.clock() - self._last_probe < self.probe_s:
            return
        if self._probing is not None and not self._probing.done():
            return
        self._last_probe = self.clock()
        self._probing = asyncio.create_task(self.probe_stale())
        if self.all_stale():
            self._set_waiting(True)

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)

    async def probe(self, url: str) -> int | None:
        """``url``'s weight version now (None: unreadable), kept in ``versions`` (a new or
        restarted engine behind the run's version joins ``joining``)."""
        v = await self._probe(url)
        if v is not None:
            self._seen(url, v)
        return v

    def _seen(self, url: str, version: int) -> None:
        """A probe found ``url`` on ``version``: kept, and judged new or restarted."""
        before = self.versions.get(url)
        self.versions[url] = int(version)
        if url != self._router_url() and self._loads():
            self.joins(url, int(version), before)

    def _loads(self) -> bool:
        """Whether the client can load weights into one engine (``push_weights``, what the
        rolling pull loads a joining engine with): without it no engine is held out to
        join, as none could be loaded."""
        return callable(getattr(self._client(), "push_weights", None))

    async def loaded(self, url: str, version: int) -> None:
        """``url`` reports ``version`` after loading it (a rolling update): back in
        rotation if it may serve (a new or restarted engine: it loaded the newest)."""
        self.versions[url] = int(version)
        self.joining.discard(url)
        if self.expected is not None and self.fits(version):
            await self.restore(url, self.expected)
            if not self.all_stale():
                self._set_waiting(False)

    async def _probe(self, url: str) -> int | None:
        probe = optional_calls(self._client()).version
        if probe is None:
            return None  # a client without the version probe: no engine is probed
        try:
            return int(await asyncio.wait_for(probe.weight_version(url), self.probe_timeout_s))
        except (EngineError, asyncio.TimeoutError) as exc:
            log.debug("probe of %s failed: %s", url, exc)
            return None

    # -- helpers ----------------------------------------------------------------------------
    def _worker_urls(self) -> list[str]:
        client = self._client()
        return [] if client is None else list(client.worker_urls)

    def _router_url(self) -> str | None:
        return optional_calls(self._client()).router_url

    def _describe(self) -> str:
        out = [f"{u} at {v}" for u, v in sorted(self.stale.items())]
        out += [f"{u} at {self.versions.get(u)} (joining)" for u in sorted(self.joining)
                if u not in self.stale]
        return ", ".join(out) or "-"

    def _set_waiting(self, on: bool) -> None:
        if on == self.waiting:
            return
        self.waiting = on
        if on:
            log.error("producer %s: every engine is on weights other than the run's version "
                      "%s (%s); claiming and generating nothing until the trainer pushes "
                      "them (engines/ lists them; docs/troubleshooting.md)", self.producer_id,
                      self.expected, self._describe())
        else:
            log.warning("producer %s: an engine holds the run's version %s again; generating",
                        self.producer_id, self.expected)


class GuardedClient:
    """Any :class:`EngineClient`, with the producer's :class:`VersionGuard` on every
    segment: requests go only to engines in rotation (:class:`NoFreshEngine` when none
    is), and a reply from weights other than the run's raises :class:`StaleEngine` before
    it is returned (no token of it is applied)."""

    def __init__(self, inner: EngineClient, guard: VersionGuard) -> None:
        self.inner = inner
        self.guard = guard

    @property
    def worker_urls(self) -> list[str]:
        return self.inner.worker_urls

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, among: Sequence[str] | None = None,
                       extra: Mapping[str, Any] | None = None,
                       live: MutableSet[str] | None = None,
                       on_chunk: Callable[[GenerateResult], None] | None = None
                       ) -> GenerateResult:
        urls = self.guard.route(
            self.guard.usable(list(self.inner.worker_urls if among is None else among)))
        kw: dict[str, Any] = {}
        if on_chunk is not None and takes_chunks(self.inner):
            # only chunks all of the run's version get through
            kw["on_chunk"] = lambda chunk: on_chunk(chunk) if self.guard.fresh(chunk) else None
        sent = self.guard.loads_ended
        result = await self.inner.generate(input_ids, sampling_params, rid=rid, among=urls,
                                           extra=extra, live=live, **kw)
        # raises StaleEngine: no token from the wrong weights
        await self.guard.check(result, sent=sent)
        pref = RESUMING.get()
        if pref is None:
            self.guard.check_born(result)
        else:  # what resuming cost: prefix tokens prefilled again
            self.guard.book.bump("resumed_tokens", pref[1])
            if result.prompt_tokens is not None:
                cached = int(result.cached_tokens or 0)
                self.guard.book.bump("resumed_tokens_prefilled", min(
                    pref[1], max(0, int(result.prompt_tokens) - cached)))
            if int(result.weight_version) != pref[0]:
                # the prefix was sampled on other weights than the engine it resumes on
                self.guard.book.bump("resumed_tokens_other_version", pref[1])
        return result

    async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
        await self.inner.abort(rid=rid, url=url)


class ClientSlot:
    """A producer's engine client from ``run()``'s start to its end: the injected one, or
    one built by ``make`` at the start (and closed at the end); ``guarded`` is it behind
    the producer's :class:`VersionGuard`, what the runner generates on."""

    def __init__(self, client: EngineClient | None, make: Callable[[], EngineClient]) -> None:
        self._raw = client
        self._owned = client is None
        self._make = make
        self._guarded: GuardedClient | None = None

    def raw(self) -> EngineClient | None:
        """The client itself (None while the producer is not running and none was given)."""
        return self._raw

    def guarded(self) -> EngineClient:
        """The client behind the version guard (only while the producer runs)."""
        if self._raw is None or self._guarded is None:
            raise RuntimeError("producer not running: its engine client starts in run()")
        return self._guarded

    def open(self, guard: VersionGuard) -> EngineClient:
        """Build the client if none was given; returns it."""
        if self._raw is None:
            self._raw = self._make()
        self._guarded = GuardedClient(self._raw, guard)
        return self._raw

    async def close(self) -> None:
        """Close the client it built (an injected one is its owner's to close)."""
        if self._owned and self._raw is not None:
            await self._raw.close()
            self._raw = None
        self._guarded = None
