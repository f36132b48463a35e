"""The run's η policy, published by the collector where every claimer can read it.

The collector is the one writer of policy decisions (``CollectorConfig.max_staleness`` η
and ``eta_mode``). When it takes the fence it publishes its policy as
``collector/policy-<epoch>`` (one exclusive create per epoch: the newest epoch's policy
wins, a stalled predecessor's never replaces it). A producer that claims a *partial* task
(prefixes saved at a weight update) reads that policy and the current weight version
before it spends a token on the prefix (``EtaPolicy.partial_action``):

* ``train``: the prefix is resumed as before, and counted;
* ``regenerate``: the prefix is discarded and the task goes back to the queue to be
  generated afresh (``RunQueue.regenerate``: a counted attempt, fresh sampling seeds);
* ``drop``: the task is dropped with reason ``stale_eta``;
* ``off`` (or no η): nothing.

A prefix is past the bound when ``current version − its oldest token's version > η``: it can
only be trained staler still. One at or under η now may still be over η when its batch
forms; the collector's batch-time check (``Collector._ordered_ready``) applies to it then.
Without a published policy (a run whose collector has not started yet) nothing is checked
at claim. See ``docs/tuning.md`` §3a.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from strawq import records
from strawq.errors import AlreadyExists, ConfigError, CorruptRecord, NotFound
from strawq.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)

POLICY_DIR = "collector"
POLICY_PREFIX = "policy-"
#: policy records kept (the newest); older epochs' are deleted by the publisher
KEEP = 2
#: seconds a claimer trusts the policy it read (its own monotonic clock): the policy only
#: changes when a collector restarts with another config
READ_INTERVAL_S = 5.0
#: reason of a task dropped, or a note of a prefix discarded, for the η bound
STALE_REASON = "stale_eta"
#: the modes a policy may carry (``requeue`` is the old name of ``regenerate``)
MODES = ("train", "regenerate", "drop", "off", "requeue")


@dataclass(frozen=True)
class EtaPolicy:
    """η (None: unbounded) and what to do with work past it."""

    max_staleness: int | None
    eta_mode: str = "train"
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.eta_mode not in MODES:
            raise ConfigError(f"eta_mode must be one of {list(MODES)}, found {self.eta_mode!r}")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool) or
                                               not isinstance(self.max_staleness, int) or
                                               self.max_staleness < 0):
            raise ConfigError(f"max_staleness must be an int >= 0 or None, found "
                              f"{self.max_staleness!r}")

    def partial_action(self, version: int, min_version: int, *, attempts: int = 0,
                       max_attempts: int | None = None) -> str | None:
        """What a claimer does with a prefix whose oldest token is ``min_version`` when the
        current version is ``version``: None (within η, or no bound), else ``train``,
        ``regenerate`` or ``drop``. A task that has used ``max_attempts`` attempts is not
        regenerated again: it is trained with its correction (``train``), so a prompt whose
        responses keep running past η cannot cycle for ever (``regenerate_or_train``)."""
        if self.max_staleness is None or self.eta_mode == "off":
            return None
        if version - min_version <= self.max_staleness:
            return None
        action = "regenerate" if self.eta_mode == "requeue" else self.eta_mode
        return regenerate_or_train(action, attempts, max_attempts)


def regenerate_or_train(action: str, attempts: int, max_attempts: int | None) -> str:
    """``regenerate`` until a task has used ``max_attempts`` attempts, then ``train``: the
    cap on regeneration cycles, the same at claim (producers) and at batch time (collector)."""
    if action == "regenerate" and max_attempts is not None and attempts >= max_attempts:
        return "train"
    return action


def _key(epoch: int) -> str:
    return f"{POLICY_DIR}/{POLICY_PREFIX}{epoch:012d}"


def _epochs(storage: Storage) -> list[int]:
    out = []
    for n in storage.list(POLICY_DIR):
        rest = n[len(POLICY_PREFIX):]
        if n.startswith(POLICY_PREFIX) and rest.isdigit():
            out.append(int(rest))
    return sorted(out)


def publish_policy(storage: Storage, policy: EtaPolicy) -> None:
    """Publish ``policy`` for its epoch (idempotent for a retried call); prune old ones."""
    body = {"max_staleness": policy.max_staleness, "eta_mode": policy.eta_mode,
            "epoch": policy.epoch, "at": time.time()}
    storage.makedirs(POLICY_DIR)
    try:
        storage.publish(_key(policy.epoch), records.encode(Kind.STATE, body))
    except AlreadyExists:
        pass  # this epoch's policy stands (a retried start of the same collector)
    for old in _epochs(storage)[:-KEEP]:
        storage.delete(_key(old))


def read_policy(storage: Storage) -> EtaPolicy | None:
    """The newest epoch's policy; None when none was published or it cannot be read (a
    warning: the claim-time check is then skipped, the batch-time one still applies)."""
    for epoch in reversed(_epochs(storage)):
        key = _key(epoch)
        try:
            meta = records.decode(storage.read(key), expect=Kind.STATE, name=key).meta
            return EtaPolicy(meta.get("max_staleness"), str(meta.get("eta_mode", "train")),
                             int(meta.get("epoch", epoch)))
        except NotFound:
            continue  # pruned between the listing and the read: an older one follows
        except (CorruptRecord, ConfigError, TypeError, ValueError) as exc:
            log.warning("the collector's η policy %s is unreadable (%s); partial tasks are "
                        "not checked against η at claim", key, exc)
            return None
    return None


class PolicyCache:
    """A claimer's copy of the published policy, read again every ``interval_s``."""

    def __init__(self, storage: Storage, *, interval_s: float = READ_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.storage = storage
        self.interval_s = interval_s
        self.clock = clock
        self._policy: EtaPolicy | None = None
        self._read_at = float("-inf")

    def get(self) -> EtaPolicy | None:
        now = self.clock()
        if now - self._read_at >= self.interval_s:
            self._policy = read_policy(self.storage)
            self._read_at = now
        return self._policy
