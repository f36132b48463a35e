"""Engines that need weights: durable notes from producers to the trainer, under ``engines/``.

A producer that finds an engine on weights other than the run's version (a restart on an
old checkpoint, a push that failed, a new worker behind a router) takes it out of its
rotation and writes one note here; the trainer's side (``WeightUpdateBracket``) lists the
notes and pushes the run's weights to those engines through its ordinary push path::

    engines/<url key>~<writer>~<nonce>     one note: url, the version the engine reported,
                                           the run's version then, why, when

``<url key>`` is a hash of the engine's base URL (URLs are not valid file names). Notes are
written once under a fresh name and deleted, never rewritten: the trainer deletes an
engine's notes after a push to it succeeded; a producer deletes its own once the engine
reports the run's version again. A note whose engine is already repaired only costs one
more (idempotent) push.

**Notes clear themselves.** Whoever probes an engine and finds it on the run's version
deletes every note on it up to that version, whoever wrote them (``clear_fixed``): a
producer that probes every engine (at start, after each bracket) clears the notes a dead
producer left, and the trainer's repair path probes the noted engines before it pushes, so
a note outlives neither its writer nor the fix. ``strawq forget-engine`` remains for an
engine retired for good (no probe can reach it).

**Known engines.** Producers register every engine URL they send requests to, once each,
under ``engine-urls/`` (one name per URL, the same bytes whoever writes it)::

    engine-urls/<url key>                  one engine's base URL

so that the trainer's side and ``strawq bracket status|finish`` can ask each engine which
weight version it holds (``probe_versions``: SGLang's and the local engines'
``GET /model_info`` ``weight_version``, short timeouts, all at once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from strawq.errors import AlreadyExists, CorruptRecord, NotFound, StrawqError
from strawq.ondisk import records
from strawq.ondisk.names import validate_id
from strawq.ondisk.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)

ENGINES_DIR = "engines"
KNOWN_DIR = "engine-urls"
#: seconds one probe of an engine may take (an unreachable engine is reported, not waited for)
PROBE_TIMEOUT_S = 2.0


def url_key(url: str) -> str:
    """A file-name-safe key for an engine's base URL."""
    return hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StaleNote:
    """One producer's (or trainer's) note that an engine needs the run's weights."""

    name: str
    url: str
    #: the version the engine reported (None: it could not be read)
    engine_version: int | None
    #: the run's version when the note was written
    run_version: int
    writer: str
    reason: str
    at: float


@dataclass(frozen=True)
class EngineProbe:
    """What one engine said when asked for its weight version."""

    url: str
    #: the weight version it reports (None: it could not be read; ``error`` says why)
    version: int | None
    error: str | None = None
    #: False: it did not answer at all (refused, reset, timed out); a push cannot reach it
    reachable: bool = True

    def describe(self) -> str:
        return f"holds version {self.version}" if self.version is not None else \
            f"unreachable ({self.error})"


#: direct connections, as the producers' client makes them (no proxy from the environment)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe_version(url: str, *, timeout_s: float = PROBE_TIMEOUT_S,
                  api_key: str | None = None) -> EngineProbe:
    """``GET {url}/model_info`` and read its ``weight_version`` (an integer, or an integer
    string as SGLang reports it); never raises, never waits longer than ``timeout_s``."""
    url = url.rstrip("/")
    req = urllib.request.Request(f"{url}/model_info", headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            body = json.loads(resp.read(1 << 20))
    except urllib.error.HTTPError as exc:
        hint = " (an engine started with --api-key: pass its key)" if exc.code == 401 else ""
        return EngineProbe(url, None, f"HTTP {exc.code} from /model_info{hint}")
    except (urllib.error.URLError, OSError) as exc:
        why = getattr(exc, "reason", exc)
        if isinstance(why, TimeoutError):
            return EngineProbe(url, None, f"no answer within {timeout_s:g}s", False)
        return EngineProbe(url, None, f"cannot reach it: {why}", False)
    except ValueError as exc:
        return EngineProbe(url, None, f"/model_info is not JSON: {exc}")
    value = body.get("weight_version") if isinstance(body, Mapping) else None
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        return EngineProbe(url, int(str(value)))
    except (TypeError, ValueError):
        return EngineProbe(url, None, f"weight_version {value!r} is not an integer")


def probe_versions(urls: Iterable[str], *, timeout_s: float = PROBE_TIMEOUT_S,
                   api_key: str | None = None) -> dict[str, EngineProbe]:
    """Probe every engine at once (URL -> its probe, sorted); the whole call takes about one
    ``timeout_s`` however many engines do not answer."""
    todo = sorted({u.rstrip("/") for u in urls})
    found: dict[str, EngineProbe] = {}

    def one(url: str) -> None:
        found[url] = probe_version(url, timeout_s=timeout_s, api_key=api_key)

    # one daemon thread per engine: a name lookup that hangs (not bounded by the socket
    # timeout) is reported, and holds neither this call nor the process's exit
    threads = [threading.Thread(target=one, args=(u,), daemon=True, name="strawq-probe")
               for u in todo]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return {u: found.get(u) or EngineProbe(u, None, f"no answer within {timeout_s:g}s", False)
            for u in todo}


class EngineWeights:
    """Read and write the notes of ``engines/`` on the run's storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def mark(self, url: str, *, writer: str, engine_version: int | None, run_version: int,
             reason: str) -> str:
        """Write a note that ``url`` needs the weights of ``run_version``; returns its name."""
        validate_id(writer, "writer id")
        name = f"{url_key(url)}~{writer}~{uuid.uuid4().hex[:12]}"
        self.storage.makedirs(ENGINES_DIR)
        self.storage.publish(f"{ENGINES_DIR}/{name}", records.encode(Kind.STATE, {
            "url": url.rstrip("/"), "engine_version": engine_version,
            "run_version": int(run_version), "writer": writer, "reason": reason[:500],
            "at": time.time()}))
        return name

    def notes(self) -> list[StaleNote]:
        """Every readable note; an unreadable one is logged and skipped (and left for an
        operator: it names no engine this code could trust)."""
        out = []
        for name in self.storage.list(ENGINES_DIR):
            key = f"{ENGINES_DIR}/{name}"
            try:
                meta = records.decode(self.storage.read(key), expect=Kind.STATE,
                                      name=key).meta
                ev = meta.get("engine_version")
                out.append(StaleNote(name, str(meta["url"]),
                                     None if ev is None else int(ev), int(meta["run_version"]),
                                     str(meta["writer"]), str(meta.get("reason", "")),
                                     float(meta.get("at", 0.0))))
            except NotFound:
                continue  # deleted meanwhile (repaired)
            except (CorruptRecord, KeyError, TypeError, ValueError) as exc:
                log.warning("engines/%s is unreadable (%s); skipping it", name, exc)
        return out

    def needing(self) -> dict[str, StaleNote]:
        """Engine URL -> its newest note: the engines that need the run's weights."""
        out: dict[str, StaleNote] = {}
        for n in self.notes():
            if n.url not in out or n.at > out[n.url].at:
                out[n.url] = n
        return out

    # -- known engines ------------------------------------------------------------------------
    def register(self, url: str) -> bool:
        """Record that ``url`` is one of the run's engines; False when it already was."""
        url = url.rstrip("/")
        self.storage.makedirs(KNOWN_DIR)
        try:
            self.storage.publish(f"{KNOWN_DIR}/{url_key(url)}",
                                 records.encode(Kind.STATE, {"url": url}))
        except AlreadyExists:
            return False
        return True

    def known(self) -> list[str]:
        """Every engine URL registered by a producer or named by a note, sorted."""
        urls = {n.url for n in self.notes()}
        for name in self.storage.list(KNOWN_DIR):
            key = f"{KNOWN_DIR}/{name}"
            try:
                urls.add(str(records.decode(self.storage.read(key), expect=Kind.STATE,
                                            name=key).meta["url"]))
            except NotFound:
                continue
            except (CorruptRecord, KeyError, TypeError, ValueError) as exc:
                log.warning("%s is unreadable (%s); skipping it", key, exc)
        return sorted(urls)

    def forget(self, url: str) -> int:
        """An engine retired for good: delete its notes and its registration; returns how
        many notes were deleted."""
        gone = self.clear(url)
        self.storage.delete(f"{KNOWN_DIR}/{url_key(url)}")
        return gone

    def clear_fixed(self, run_version: int, probes: Mapping[str, EngineProbe],
                    may_clear: Callable[[str], bool] | None = None) -> list[str]:
        """Delete the notes (every writer's, up to ``run_version``) on each engine whose
        probe reports ``run_version`` (and, with ``may_clear``, for which it says True:
        attestation's verdict, ``strawq.weights.fingerprint.may_clear``): it
        holds the run's weights, whoever noted it and whether or not that writer still
        runs. Returns the URLs cleared."""
        cleared = []
        for url in sorted(self.needing()):
            p = probes.get(url)
            if p is not None and p.version == run_version and \
                    (may_clear is None or may_clear(url)) and \
                    self.clear(url, up_to_version=run_version):
                cleared.append(url)
        if cleared:
            log.info("engines %s report the run's version %d: their notes are deleted",
                     ", ".join(cleared), run_version)
        return cleared

    def clear(self, url: str, *, writer: str | None = None,
              up_to_version: int | None = None) -> int:
        """Delete the notes on ``url`` (only ``writer``'s, only those written at a run
        version <= ``up_to_version``, when given); returns how many were deleted."""
        prefix = f"{url_key(url)}~"
        gone = 0
        for n in self.notes():
            if not n.name.startswith(prefix) or (writer is not None and n.writer != writer):
                continue
            if up_to_version is not None and n.run_version > up_to_version:
                continue
            try:
                self.storage.delete(f"{ENGINES_DIR}/{n.name}")
                gone += 1
            except StrawqError as exc:
                log.warning("cannot delete engines/%s: %s", n.name, exc)
        return gone
