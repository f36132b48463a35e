"""The weight-update bracket, trainer side: pause producers, push weights, resume.

Rank 0 writes ``control/pause-<v+1>``, waits until every live producer acked (it then holds
no lease, its interrupted samples parked with their prefixes), pushes the weights to every
engine, writes ``versions/<v+1>`` and ``control/resume-<v+1>``. The bracket exists so that
no token is generated on weights other than the version it is stamped with, and none is
lost at an update (docs/design.md, invariant 9).

Liveness is judged as the grantor judges leases (invariant 3): heartbeat counters observed
on this process's monotonic clock through a ``LeaseMonitor``, never file times; a producer
silent for ``liveness_timeout_s``, or whose process on this host is gone, is not waited for,
which is safe because its replies are version-stamped and its results lease-fenced
(``strawq.collector.trainer.pause_acks``). A bracket left open by a crashed trainer is
continued, settled by what the engines hold (``finish_weight_update``, deciding by
``strawq.collector.trainer.settlement.settle``) or released (``abort_weight_update``);
``restore`` is a restored trainer's first update; ``repair_engines`` pushes the run's version
to engines producers noted under ``engines/`` (``strawq.collector.trainer.engine_repair``).
Opening or closing a bracket is rank 0 only.

The protocol in full, with its diagram: docs/collector.md, "The weight-update bracket".
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from strawq.collector.trainer.bracket_publish import UpdatePublisher
from strawq.collector.trainer.engine_repair import EngineRepair, PushTo
from strawq.collector.trainer.pause_acks import ProducerLiveness
from strawq.collector.trainer.settlement import Settlement as Settlement
from strawq.collector.trainer.settlement import abort_checked, finish
from strawq.collector.trainer.settlement import settle as settle
from strawq.delivery.batches import forget_delivered_after
from strawq.errors import BracketError
from strawq.tasks.grantor import LeaseMonitor
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control
from strawq.weights.delta import MAX_DELTA_CHAIN
from strawq.weights.engine_weights import (
    PROBE_TIMEOUT_S,
    EngineProbe,
    EngineWeights,
    StaleNote,
    probe_versions,
)
from strawq.weights.fingerprint import READ_TIMEOUT_S, Fingerprint
from strawq.weights.publish import Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BracketReport:
    #: the version the bracket installs
    version: int
    #: producers that acknowledged the pause
    acked: frozenset[str]
    #: producers not waited for: silent for at least the liveness timeout, or a gone
    #: process on this host (seconds silent)
    dead: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0
    #: leases still held by producers that acked (a producer bug: ack means "holds none")
    stray_leases: list[str] = field(default_factory=list)
    #: True when this call continued a bracket a previous trainer left open
    continued: bool = False
    #: the rolling mode's manifest (None: a bracket); ``waited_s`` is then the seconds the
    #: trainer spent writing and publishing the weights, all it waits for
    published: Manifest | None = None


_RANK0_ONLY = (
    "{what}() on trainer rank {rank}: the weight-update bracket runs on rank 0 only (on "
    "every rank it would announce a new weight version once per rank and step). Call it "
    "under 'if rank == 0:', or call reader.weight_update(push) on every rank: it runs the "
    "update on rank 0 and nothing on the others. (The rank is BatchReader(rank=...)'s, "
    "WeightUpdateBracket(rank=...)'s, else the RANK environment variable.)")


def _env_rank() -> int:
    """The trainer's rank as torch's launchers give it (``RANK``; 0 when unset)."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class WeightUpdateBracket:
    """One trainer's bracket. Run it on one rank only (rank 0)."""

    def __init__(self, queue: RunQueue, *, monitor: LeaseMonitor | None = None,
                 lease_timeout_s: float | None = None, liveness_timeout_s: float | None = None,
                 poll_interval_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 repair: PushTo | None = None, repair_interval_s: float | None = 5.0,
                 rank: int | None = None, engine_urls: Sequence[str] = (),
                 probe_timeout_s: float = PROBE_TIMEOUT_S, api_key: str | None = None,
                 fence: Callable[[], None] | None = None, attest: bool = True,
                 attest_timeout_s: float = READ_TIMEOUT_S,
                 admin_api_key: str | None = None,
                 weight_update: str = "bracket", wave: float = 0.25, max_lag: int = 1,
                 max_delta_chain: int = MAX_DELTA_CHAIN, publish_dir: str | None = None
                 ) -> None:
        self.queue = queue
        #: the update's mode, rolling settings and attestation fingerprints
        self.publisher = UpdatePublisher(queue, mode=weight_update, wave=wave,
                                         max_lag=max_lag, attest=attest,
                                         publish_dir=publish_dir,
                                         max_delta_chain=max_delta_chain)
        #: called before every bracket write (``BatchReader``'s: the trainer fence, which
        #: raises ``FencedOut`` once another trainer took the run over); None: unfenced
        #: (an operator's tool settling a bracket)
        self.fence = fence
        #: the trainer rank this bracket runs on (only rank 0 may open or close it)
        self.rank = _env_rank() if rank is None else int(rank)
        #: engines to probe besides those producers registered (``engine_versions``)
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.probe_timeout_s = probe_timeout_s
        #: the engines' ``--api-key``, for the probes
        self.api_key = api_key
        self.control = Control(queue.storage)
        self.engines = EngineWeights(queue.storage)
        #: engines on other weights pushed the run's version (``strawq.collector.trainer.
        #: engine_repair``): at each ``end_weight_update`` and from a background thread
        self.repairs = EngineRepair(queue, self.engines, lambda: self.is_open,
                                    probe_timeout_s=probe_timeout_s, api_key=api_key,
                                    attest_timeout_s=attest_timeout_s,
                                    admin_api_key=admin_api_key)
        self.clock = clock
        self.sleep = sleep
        self.poll_interval_s = poll_interval_s
        #: which producers the bracket waits for, and the wait for their acks
        #: (``strawq.collector.trainer.pause_acks``)
        self.liveness = ProducerLiveness(queue, monitor=monitor, lease_timeout_s=lease_timeout_s,
                                         liveness_timeout_s=liveness_timeout_s, clock=clock)
        self._open: int | None = None
        if repair is not None:
            self.start_repairs(repair, interval_s=repair_interval_s)

    # -- liveness (``ProducerLiveness``) -------------------------------------------------------
    @property
    def monitor(self) -> LeaseMonitor:
        return self.liveness.monitor

    @property
    def lease_timeout_s(self) -> float:
        return self.liveness.lease_timeout_s

    @property
    def liveness_s(self) -> float:
        """Heartbeat silence after which a producer is not waited for."""
        return self.liveness.liveness_s

    def observe(self) -> dict[str, float]:
        """Read heartbeat counters now; returns producer -> seconds since its counter moved."""
        return self.liveness.observe()

    def live_producers(self) -> set[str]:
        """Producers to wait for: beating within the liveness timeout, not a gone process
        of this host, and not idle (an idle producer holds no lease, and leaves its idle
        mark with a beat before it reads ``control/`` and claims: seen here then)."""
        return self.liveness.live_producers()

    @property
    def is_open(self) -> bool:
        return self._open is not None or self.control.state().paused

    # -- the bracket ---------------------------------------------------------------------------
    def begin_weight_update(self, timeout: float = 300.0) -> BracketReport:
        """Pause producers for version v+1 and wait for every live producer's ack."""
        self._rank0("begin_weight_update")
        if timeout < self.liveness_s:
            log.warning("bracket timeout %.1fs is below the liveness timeout %.1fs: a "
                        "producer that died just before the pause fails the bracket instead "
                        "of being judged dead", timeout, self.liveness_s)
        st = self.control.state()
        continued = st.paused
        if continued:
            version = st.pause_version
            log.warning("continuing the weight-update bracket for version %d left open "
                        "(a previous trainer stopped inside it)", version)
        else:
            version = max(self.queue.current_version(), st.pause_version,
                          st.resume_version) + 1
        with self.repairs.lock:  # waits for a repair push in progress
            if not continued:
                self.control.pause(version)
            self._open = version
        acks, dead, waited = self.liveness.wait_for_acks(
            self.control, version, timeout, sleep=self.sleep,
            poll_interval_s=self.poll_interval_s)
        stray = self.liveness.stray_leases(acks, control=self.control, version=version)
        log.info("weight update to version %d: %d producers paused (%d dead) in %.2fs",
                 version, len(acks), len(dead), waited)
        return BracketReport(version, frozenset(acks), {p: dead[p] for p in dead
                                                        if p not in acks},
                             waited, stray, continued)

    def end_weight_update(self, version: int | None = None) -> int:
        """Announce ``version`` (default: the bracket's) and resume producers."""
        self._rank0("end_weight_update")
        opened = self._open_version()
        version = opened if version is None else int(version)
        if version < opened:
            raise BracketError(f"end_weight_update({version}): the open bracket installs "
                               f"version {opened}; expected a version >= {opened}")
        self.queue.set_version(version)
        # attestation (``strawq.weights.fingerprint``): with a fingerprint published for
        # ``version``, every engine is checked before producers resume; one that fails is
        # noted and never in their rotation at this version
        if self.publisher.attest:
            self.repairs.attest(set(self.engines.known()) | set(self.engine_urls), version,
                                reason="after the bracket's push")
        self.control.resume(version)
        self._open = None
        log.info("weight version %d is live; producers resume", version)
        self.repairs.after_update(version)  # engines on other weights (EngineRepair)
        return version

    # -- engines on other weights (``EngineRepair``) -------------------------------------------
    @property
    def repair(self) -> PushTo | None:
        """The trainer's push path limited to some engines (None: no repairs)."""
        return self.repairs.push

    def start_repairs(self, push_to: PushTo, *, interval_s: float | None = 5.0) -> None:
        """Repair engines on other weights with ``push_to(urls, version)`` after every
        ``end_weight_update`` and, unless ``interval_s`` is None, every ``interval_s`` from
        a daemon thread (``reader.bracket.start_repairs(...)`` for the reader's bracket)."""
        self.repairs.start(push_to, interval_s=interval_s)

    def engines_needing_weights(self) -> dict[str, StaleNote]:
        """Engine URL -> the newest note (``engines/``) that it is not on the run's version."""
        return self.engines.needing()

    def mark_needing_weights(self, urls: list[str], *, reason: str,
                             engine_version: int | None = None) -> None:
        """Note engines that need the run's weights (e.g. the ones a push failed on)."""
        self.repairs.mark(urls, reason=reason, engine_version=engine_version)

    def repair_engines(self, push_to: PushTo | None = None) -> list[str]:
        """Push the run's current version to every engine that needs it (``EngineRepair``);
        refused while a bracket is open (the bracket's own push reaches every engine)."""
        return self.repairs.repair(push_to)

    def close(self) -> None:
        """Stop the background repairs (the thread is a daemon: it never holds a process)."""
        self.repairs.close()

    def abort_weight_update(self, *, force: bool = False,
                            engines: Mapping[str, EngineProbe] | None = None) -> None:
        """Resume producers without announcing a new version (the weights did not change).

        Refused (``BracketError``) while an engine already holds the bracket's version: its
        weights reached the engines, and producers resumed on the old version would keep
        every such engine out of rotation; ``finish_weight_update()`` announces it instead.
        ``force=True`` aborts anyway (after putting the old weights back on them).
        ``engines``: probes just taken (default: probe now)."""
        self._rank0("abort_weight_update")
        abort_checked(self, force=force, engines=engines)

    # -- settling by what the engines hold -------------------------------------------------
    def engine_versions(self, timeout_s: float | None = None) -> dict[str, EngineProbe]:
        """Probe every known engine (registered in ``engine-urls/``, noted in ``engines/``,
        or given as ``engine_urls``) for its weight version; an unreachable one is reported
        as such after at most ``timeout_s`` (default ``probe_timeout_s``)."""
        urls = set(self.engines.known()) | set(self.engine_urls)
        return probe_versions(urls, timeout_s=timeout_s or self.probe_timeout_s,
                              api_key=self.api_key)

    def settlement(self, engines: Mapping[str, EngineProbe] | None = None) -> Settlement:
        """How ``finish_weight_update`` would settle the bracket now (``settle``)."""
        found = self.engine_versions() if engines is None else engines
        return settle(self.control.state(), self.queue.current_version(), found)

    def finish_weight_update(self, *, if_unknown: Literal["refuse", "end"] = "refuse",
                             engines: Mapping[str, EngineProbe] | None = None
                             ) -> Settlement:
        """Settle an open bracket (one a trainer that died left open, or this trainer's own)
        by the version the engines hold: announce the bracket's version when every engine
        that answered holds it, resume without a new version when every one holds the run's;
        refuse (``BracketError``, naming which holds what) when they disagree or none
        answered, unless ``if_unknown="end"`` (no engine known or reachable: announce the
        bracket's version, as ``end_weight_update``). A bracket closed by an abort while the
        engines hold its version is finished too: its version is announced now. ``engines``:
        probes just taken (default: probe now)."""
        self._rank0("finish_weight_update")
        return finish(self, if_unknown=if_unknown, engines=engines)

    def _rank0(self, what: str) -> None:
        if self.rank != 0:
            raise BracketError(_RANK0_ONLY.format(what=what, rank=self.rank))
        if self.fence is not None:
            self.fence()

    def _open_version(self) -> int:
        if self._open is not None:
            return self._open
        st = self.control.state()
        if st.paused:
            return st.pause_version
        raise BracketError("no weight-update bracket is open: call begin_weight_update() "
                           "first")

    def restore(self, push: Callable[[int], None], state: Mapping[str, Any], *,
                timeout: float = 300.0) -> BracketReport:
        """The first weight update of a trainer restored from a checkpoint: push the
        restored weights to every engine as a new version (``push(version)``, as in
        ``weight_update``) and forget the delivery marks of the batches after the
        checkpoint's ``batch_seq``. ``state`` is the checkpoint's reader state
        (``BatchReader.state_dict()``). Returns the report; ``report.version`` is the
        version the trainer's next update continues from.

        Call it after ``reader.load_state_dict(state)`` and before the first
        ``next_batch``; a bracket a dead trainer left open is continued."""
        seq = int(state.get("batch_seq") or 0)
        restored = int(state.get("version") or 0)
        rep = self.begin_weight_update(timeout)
        push(rep.version)
        forget_delivered_after(self.queue.storage, seq)
        before = self.queue.current_version()
        self.end_weight_update(rep.version)
        if before > restored:
            log.warning("restored the weights of version %d (checkpoint after batch %d) as "
                        "version %d; rollouts of versions %d..%d came from weights the "
                        "restored trainer no longer has (a discarded stretch of training): "
                        "they are trained with their importance correction, and their "
                        "per-token versions understate how far off-policy they are", restored,
                        seq, rep.version, restored + 1, before)
        else:
            log.info("restored the weights of version %d as version %d", restored,
                     rep.version)
        return rep

    # -- what an update publishes (``UpdatePublisher``) ---------------------------------------
    @property
    def mode(self) -> str:
        return self.publisher.mode

    def publish_fingerprint(self, version: int, fingerprint: Fingerprint) -> None:
        """Record the fingerprint of the weights published as ``version``
        (``fingerprint_of(weights)``): from then on every engine that claims ``version`` is
        checked against it before producers use it. Call it before ``end_weight_update``."""
        self._rank0("publish_fingerprint")
        self.publisher.fingerprint(version, fingerprint)

    def attestation_metrics(self) -> dict[str, float]:
        """The trainer's attestation counters, for ``MetricsSink.emit``."""
        return self.repairs.metrics()

    def weight_update(self, push: Callable[[int], Any], *, timeout: float = 300.0,
                      version: int | None = None,
                      fingerprint: Fingerprint | None = None) -> BracketReport:
        """``begin``, ``push(version)`` (load the new weights into every engine), ``end``;
        with ``fingerprint`` (of the pushed weights), every engine is checked against it
        before producers resume (``publish_fingerprint``). If ``push`` raises, the bracket
        stays open (producers stay paused) and the error propagates: retry, or call
        ``abort_weight_update()``. In the rolling mode ``push(version)`` writes the weights
        where every engine reads them and returns the path; ``publish_weights`` publishes
        it (the fingerprint first: engines are attested after their load).
        """
        if self.mode == "rolling":
            return self.publish_weights(push, version=version, fingerprint=fingerprint)
        rep = self.begin_weight_update(timeout)
        target = rep.version if version is None else version
        if fingerprint is not None:
            self.publish_fingerprint(target, fingerprint)
        push(target)
        self.end_weight_update(target)
        return rep

    def publish_weights(self, write: Callable[[int], Any], *, version: int | None = None,
                        fingerprint: Fingerprint | None = None) -> BracketReport:
        """The rolling mode's update: ``write(v)`` writes version v's weights (complete)
        and returns their directory; published (with ``publish_dir``: copied there, whole
        or as a delta) under ``weights/``, v announced. Nothing is paused, no engine waited
        for: producers load v in waves (``strawq.producers.rolling``). Refused in a bracket.
        ``fingerprint``: published first, engines are attested after their load."""
        self._rank0("publish_weights")
        target, m, waited = self.publisher.rolling(
            write, version=version, open_version=self._open, control=self.control,
            fleet=len(set(self.engines.known()) | set(self.engine_urls)), clock=self.clock,
            fingerprint=fingerprint)
        return BracketReport(target, frozenset(), {}, waited, [], False, published=m)
