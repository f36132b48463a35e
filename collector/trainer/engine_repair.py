"""Engines on other weights, brought back: the trainer side of the ``engines/`` notes.

A producer that finds an engine on weights other than the run's takes it out of rotation and
notes it (``strawq.weights.engine_weights``). The trainer's push path limited to some engines,
``push_to(urls, version)``, repairs them: after each weight update
(``WeightUpdateBracket.end_weight_update``) and every ``interval_s`` from a daemon thread, so
that a trainer waiting for a batch while every engine is stale is not stuck. A repair never
overlaps a bracket (``lock``): the bracket's own push reaches every engine. An engine that
already reports the run's version needs no push: its notes go.

**Attestation** (``strawq.weights.fingerprint``). When the run's version has a fingerprint,
"reports the run's version" is not enough: an engine is checked (its parameter slices read
back and compared) before its notes go, after every push to it, and every engine after the
bracket's push (:meth:`EngineRepair.attest`, called by ``end_weight_update`` before it
resumes producers). An engine that fails is noted (``engines/``, reason "failed
attestation") and stays out of the producers' rotation until a push makes it pass.

**Engines that do not answer** (a previous incarnation's engines after a restart on new
ports, a node that is gone) are neither checked nor pushed to: each is noted once (it stays
out of rotation) and skipped while it stays silent; a repair probes it at each round and
pushes the run's weights once it answers again. It counts in ``attest/unreachable_total``,
not as a failed attestation. ``strawq forget-engine`` retires one for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from strawq.errors import BracketError
from strawq.tasks.queue import RunQueue
from strawq.weights.engine_weights import EngineWeights, probe_versions
from strawq.weights.fingerprint import (
    READ_TIMEOUT_S,
    Fingerprints,
    Verdict,
    attest_all,
    may_clear,
)

log = logging.getLogger(__name__)

#: the trainer's push path limited to some engines: ``push_to(urls, version)``; returns the
#: URLs it failed on (None or empty: all took the weights) or raises
PushTo = Callable[[list[str], int], "Iterable[str] | None"]


class EngineRepair:
    """Pushes the run's version to the engines noted on other weights."""

    def __init__(self, queue: RunQueue, engines: EngineWeights, is_open: Callable[[], bool],
                 *, probe_timeout_s: float, api_key: str | None = None,
                 attest_timeout_s: float = READ_TIMEOUT_S,
                 admin_api_key: str | None = None) -> None:
        self.queue = queue
        self.engines = engines
        self._is_open = is_open
        self.probe_timeout_s = probe_timeout_s
        self.api_key = api_key
        #: the trainer's push path limited to some engines (None: repairs are off)
        self.push: PushTo | None = None
        #: held by a repair push, and by a bracket while it opens: they never overlap
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures: set[str] = set()
        self.fingerprints = Fingerprints(queue.storage)
        self.attest_timeout_s = attest_timeout_s
        #: ``/get_weights_by_name`` is an admin call on SGLang (``--admin-api-key``)
        self.attest_api_key = admin_api_key or api_key
        #: engines checked / failed, seconds of the last round of checks (trainer metrics)
        self.attest_checks = 0
        self.attest_failures = 0
        self.attest_unreachable = 0
        self.attest_last_s = 0.0
        #: engines seen silent and not heard from since (logged once, not at every round)
        self._silent: set[str] = set()

    def metrics(self) -> dict[str, float]:
        """The attestation counters (``attest/...``), for ``MetricsSink.emit``."""
        return {"attest/checks_total": self.attest_checks,
                "attest/failures_total": self.attest_failures,
                "attest/unreachable_total": self.attest_unreachable,
                "attest/last_s": self.attest_last_s}

    def start(self, push_to: PushTo, *, interval_s: float | None = 5.0) -> None:
        """Repair with ``push_to`` from now on; every ``interval_s`` from a daemon thread
        too, unless it is None."""
        self.push = push_to
        if interval_s is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(interval_s,),
                                            daemon=True, name="strawq-engine-repair")
            self._thread.start()

    def mark(self, urls: list[str], *, reason: str, engine_version: int | None = None) -> None:
        """Note engines that need the run's weights (e.g. the ones a push failed on)."""
        v = self.queue.current_version()
        for url in urls:
            self.engines.mark(url, writer="trainer", engine_version=engine_version,
                              run_version=v, reason=reason)

    def repair(self, push_to: PushTo | None = None) -> list[str]:
        """Push the run's current version to every engine that needs it, through
        ``push_to(urls, version)`` (default: ``push``); returns the URLs that took it.

        Refused while a bracket is open. If ``push_to`` raises, the notes stay and the error
        propagates."""
        push = push_to or self.push
        if push is None:
            raise BracketError("repair_engines() needs push_to(urls, version): the trainer's "
                               "push path limited to some engines")
        with self.lock:
            if self._is_open():
                raise BracketError("repair_engines() while a weight-update bracket is open: "
                                   "the bracket's push reaches every engine; repair after "
                                   "end_weight_update()")
            return self._repair(push)

    def after_update(self, version: int) -> None:
        """A bracket announced ``version``: repair the engines on other weights; with no
        repair configured, drop the notes of those that report it now and warn about the
        rest (the next update's push may reach them)."""
        if self.push is not None:
            try:
                self.repair()
            except Exception as exc:  # noqa: BLE001 - the update itself succeeded
                log.error("repairing engines after version %d failed: %s; they stay out of "
                          "rotation (retry with repair_engines())", version, exc)
            return
        need = self.engines.needing()
        if need:  # the notes on engines that report the version now go
            fixed = self.engines.clear_fixed(version, probe_versions(
                need, timeout_s=self.probe_timeout_s, api_key=self.api_key),
                may_clear(self.queue.storage, version))
            need = {u: n for u, n in need.items() if u not in fixed}
        if need:
            log.warning("engines %s are on weights other than the run's version and out "
                        "of rotation; no repair is configured (WeightUpdateBracket("
                        "repair=...) or start_repairs()): the next update's push may "
                        "reach them", ", ".join(sorted(need)))

    def attest(self, urls: Iterable[str], version: int, *,
               reason: str = "after its push") -> dict[str, Verdict]:
        """Check each engine against ``version``'s fingerprint (none: {}), record the
        verdicts, note those that fail or do not answer (``engines/``) and return every
        verdict (``reachable=False``: it did not answer; no verdict on its weights)."""
        urls = sorted(set(urls))
        if not urls:
            return {}
        found = attest_all(self.queue.storage, urls, version,
                           timeout_s=self.attest_timeout_s, api_key=self.attest_api_key)
        if not found:
            return {}
        checked = [v for v in found.values() if v.reachable]
        self.attest_checks += len(checked)
        self.attest_last_s = sum(v.seconds for v in found.values())
        bad = [v for v in checked if not v.ok]
        self.attest_failures += len(bad)
        for v in bad:
            log.error("%s (%s): out of rotation, noted for a repair push", v.describe(),
                      reason)
            self.engines.mark(v.url, writer="trainer", engine_version=version,
                              run_version=version, reason=f"failed attestation: "
                              f"{v.error or 'fingerprint ' + str(v.found)}")
        self._note_silent([v.url for v in found.values() if not v.reachable],
                          {v.url: v.error or "" for v in found.values()}, version)
        log.info("attestation at version %d: %d of %d engines match, %d did not answer "
                 "(%.2fs)", version, len(checked) - len(bad), len(found),
                 len(found) - len(checked), self.attest_last_s)
        return found

    def _note_silent(self, urls: list[str], why: dict[str, str], version: int) -> None:
        """Engines that did not answer: counted, noted once (out of rotation until a
        repair reaches them), logged once until they answer again."""
        self.attest_unreachable += len(urls)
        noted = self.engines.needing() if urls else {}
        for url in urls:
            if url not in noted:
                self.engines.mark(url, writer="trainer", engine_version=None,
                                  run_version=version, reason=f"unreachable: {why[url]}"[:500])
            if url not in self._silent:
                log.warning("%s does not answer (%s): out of rotation until it answers "
                            "again; a repair pushes the run's weights then (an engine retired "
                            "for good: strawq forget-engine)", url, why.get(url))
        self._silent |= set(urls)

    def _repair(self, push: PushTo) -> list[str]:
        need = self.engines.needing()
        if not need:
            return []
        version = self.queue.current_version()
        probes = probe_versions(need, timeout_s=self.probe_timeout_s, api_key=self.api_key)
        # an engine on the run's version with no verdict yet (it joined, or was noted before
        # the check) is checked now; one that fails gets the push
        self.attest([u for u, p in probes.items() if p.version == version and
                     self.fingerprints.attested(u, version) is None], version,
                    reason="on the run's version, not yet checked")
        # an engine that already holds the run's version (attested) needs no push: its
        # notes go
        fixed = self.engines.clear_fixed(version, probes, may_clear(self.queue.storage, version))
        need = {u: n for u, n in need.items() if u not in fixed}
        # an engine that does not answer cannot take a push (each try would wait out the
        # push path's retries at every round): skipped until a probe reaches it
        silent = [u for u in need if not probes[u].reachable]
        self._silent -= {u for u, p in probes.items() if p.reachable}
        if silent:
            log.debug("skipping %d engines that do not answer: %s", len(silent),
                      ", ".join(silent))
            self._silent |= set(silent)
            need = {u: n for u, n in need.items() if u not in silent}
        if not need:
            return []
        urls = sorted(need)
        log.warning("pushing the run's version %d to %d engines on other weights: %s",
                    version, len(urls), ", ".join(
                        f"{u} (at {need[u].engine_version})" for u in urls))
        failed = set(push(urls, version) or ())
        done = [u for u in urls if u not in failed]
        verdicts = self.attest(done, version)
        refused = {u for u in done if u in verdicts and not verdicts[u].ok}
        done = [u for u in done if u not in refused]
        failed |= refused
        for u in done:
            self.engines.clear(u, up_to_version=version)
        if failed - self._failures:  # once per engine, not at every retry
            log.error("push of version %d failed on %s; they stay out of rotation (a note "
                      "of an engine retired for good: delete it from engines/)",
                      version, ", ".join(sorted(failed)))
        self._failures = (self._failures | failed) - set(done)
        if done:
            log.info("engines %s now hold version %d", ", ".join(done), version)
        return done

    def _loop(self, interval_s: float) -> None:
        last = ""
        while not self._stop.wait(interval_s):
            try:
                if not self._is_open() and self.engines.needing():
                    self.repair()
                last = ""
            except BracketError:
                continue  # a bracket opened meanwhile: its push reaches every engine
            except Exception as exc:  # noqa: BLE001 - keep trying; the notes stay
                if str(exc) != last:  # once per distinct failure, not every interval
                    log.error("repairing engines failed: %s; retrying every %.0fs", exc,
                              interval_s)
                last = str(exc)

    def close(self) -> None:
        """Stop the background repairs (the thread is a daemon: it never holds a process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
