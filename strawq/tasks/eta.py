"""The run's η policy, published by the collector where every claimer can read it.

The collector is the one writer of policy decisions (``CollectorConfig.max_staleness`` η
and ``eta_mode``). When it takes the fence it publishes its policy as
``collector/policy-<epoch>`` (one exclusive create per epoch: the newest epoch's policy
wins, a stalled predecessor's never replaces it). A producer that claims a *partial* task
(prefixes saved at a weight update) reads that policy and the current weight version
before it spends a token on the prefix (``EtaPolicy.partial_action``):

* ``hard`` (the default) and ``train``: the prefix is resumed, and counted (under ``hard``
  the collector's schedule keeps such prefixes from arising: ``strawq.collector.deadlines``);
* ``regenerate``: the prefix is discarded and the task goes back to the queue to be
  generated afresh (``RunQueue.regenerate``: a counted attempt, fresh sampling seeds);
* ``drop``: the task is dropped with reason ``stale_eta``;
* ``off`` (or no η): nothing.

Every "over η?" question — a prefix at claim, a ready group at batch time, a sample at read
time — is ``EtaPolicy.over(version, min_version)``: ``staleness(version, min_version) > η``
(``strawq.ondisk.groups.staleness``). A prefix over η now can only be trained staler still. One
at or under η now may still be over η when its batch forms; the collector's batch-time
check (``EtaJudge.ordered_ready``, ``strawq.collector.eta_judge``) applies to it then.
Without a published policy (a run whose collector has not started yet) nothing is checked
at claim. See ``docs/tuning.md`` §3a.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from strawq.errors import AlreadyExists, ConfigError, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.ondisk.staleness import staleness
from strawq.storage import Storage

if TYPE_CHECKING:  # numpy loads when a per-sample mask is asked for
    import numpy as np

log = logging.getLogger(__name__)

POLICY_DIR = "collector"
POLICY_PREFIX = "policy-"
#: ``collector/policy-<E>``
POLICIES = Numbered(POLICY_PREFIX)
#: policy records kept (the newest); older epochs' are deleted by the publisher
KEEP = 2
#: seconds a claimer trusts the policy it read (its own monotonic clock): the policy only
#: changes when a collector restarts with another config
READ_INTERVAL_S = 5.0
#: reason of a task dropped, or a note of a prefix discarded, for the η bound
STALE_REASON = "stale_eta"
#: What is done with work over η — the one declaration of the vocabulary:
#: ``hard`` (the default: the collector holds a batch back until every group that would
#: otherwise miss η is in it, ``strawq.collector.deadlines``; nothing is dropped or
#: regenerated, and a group the hold still could not place in time — a window above
#: (η + 1)·u, a restart — is trained with its correction and counted, as under ``train``),
#: ``train`` (soft: kept, trained with its correction, counted), ``regenerate`` (generated again
#: from scratch), ``drop`` (dropped with reason ``stale_eta``), ``off`` (admission only,
#: never judged); ``requeue`` is accepted as another name of ``regenerate``.
EtaMode = Literal["hard", "train", "regenerate", "drop", "off", "requeue"]
MODES: tuple[str, ...] = get_args(EtaMode)
#: ``eta_mode`` a run gets when its configuration does not say (docs/changes.md: it was
#: ``train`` before)
DEFAULT_ETA_MODE: EtaMode = "hard"
#: η a run gets when its configuration does not say (docs/tuning.md §3a): one version
DEFAULT_MAX_STALENESS = 1


@dataclass(frozen=True)
class EtaPolicy:
    """η (None: unbounded) and what to do with work past it."""

    max_staleness: int | None
    eta_mode: str = DEFAULT_ETA_MODE
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.eta_mode not in MODES:
            raise ConfigError(f"eta_mode must be one of {list(MODES)}, found {self.eta_mode!r}")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool) or
                                               not isinstance(self.max_staleness, int) or
                                               self.max_staleness < 0):
            raise ConfigError(f"max_staleness must be an int >= 0 or None, found "
                              f"{self.max_staleness!r}")

    @property
    def bounded(self) -> bool:
        """A bound applies: η is set (work over it is then judged, unless ``off``)."""
        return self.max_staleness is not None

    @property
    def judges(self) -> bool:
        """Work over η gets a verdict (``action``): η is set and the mode is not ``off``."""
        return self.max_staleness is not None and self.eta_mode != "off"

    @property
    def hard(self) -> bool:
        """η is a hard bound: the collector plans batches so that no group misses it
        (``strawq.collector.deadlines``); η is set and the mode is ``hard``."""
        return self.max_staleness is not None and self.eta_mode == "hard"

    @property
    def mode(self) -> str:
        """The mode under its one name (``requeue`` reads as ``regenerate``)."""
        return "regenerate" if self.eta_mode == "requeue" else self.eta_mode

    def over(self, version: int, min_version: int) -> bool:
        """Is work whose oldest token is ``min_version`` over η when trained at ``version``?

        The one η judgement (False when η is unbounded); ``over_each`` asks it per sample.
        Whether the answer is acted on is ``judges``."""
        return bool(self._exceeds(staleness(version, min_version)))

    def over_each(self, version: int, min_versions: np.ndarray) -> np.ndarray:
        """``over`` for an array of per-sample oldest versions: a bool mask."""
        import numpy as np

        return np.asarray(self._exceeds(staleness(version, np.asarray(min_versions))),
                          dtype=bool)

    def _exceeds(self, stale: Any) -> Any:
        """``stale > η`` for a staleness or an array of them (all False without a bound)."""
        if self.max_staleness is None:
            import numpy as np

            return np.zeros(np.shape(stale), dtype=bool)
        return stale > self.max_staleness

    def action(self, version: int, min_version: int, *, attempts: int = 0,
               max_attempts: int | None = None) -> str | None:
        """The verdict on work whose oldest token is ``min_version``, trained at ``version``:
        None (within η, no bound, or ``off``), else ``train``, ``regenerate`` or ``drop``
        (``hard``: ``train``, the work the schedule could not finish in time is kept).
        ``attempts`` counts the task's generations (a regeneration spends no failure
        attempt): one generated ``max_attempts`` times is not regenerated again: it is
        trained with its correction (``train``), so a prompt whose responses keep running
        past η cannot cycle for ever (``regenerate_or_train``). The same at claim
        (producers, on a partial's prefix) and at batch time (the collector)."""
        if not self.judges or not self.over(version, min_version):
            return None
        if self.mode == "hard":
            return "train"
        return regenerate_or_train(self.mode, attempts, max_attempts)

    def partial_action(self, version: int, min_version: int, *, attempts: int = 0,
                       max_attempts: int | None = None) -> str | None:
        """``action`` for a claimed partial's prefix (the producers' entry point)."""
        return self.action(version, min_version, attempts=attempts, max_attempts=max_attempts)

    def to_meta(self) -> dict[str, Any]:
        """The fields a manifest records (``from_meta`` reads them back)."""
        return {"max_staleness": self.max_staleness, "eta_mode": self.eta_mode}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> EtaPolicy:
        """The policy a manifest (or a published policy record) was judged under; a record
        without one reads as unbounded."""
        eta = meta.get("max_staleness")
        return cls(None if eta is None else int(eta),
                   str(meta.get("eta_mode", DEFAULT_ETA_MODE)),
                   int(meta.get("epoch", 0) or 0))


def regenerate_or_train(action: str, attempts: int, max_attempts: int | None) -> str:
    """``regenerate`` until a task has used ``max_attempts`` attempts, then ``train``: the
    cap on regeneration cycles, the same at claim (producers) and at batch time (collector)."""
    if action == "regenerate" and max_attempts is not None and attempts >= max_attempts:
        return "train"
    return action


def _key(epoch: int) -> str:
    return f"{POLICY_DIR}/{POLICIES.name(epoch)}"


def _epochs(storage: Storage) -> list[int]:
    return POLICIES.numbers(storage.list(POLICY_DIR))


def publish_policy(storage: Storage, policy: EtaPolicy) -> None:
    """Publish ``policy`` for its epoch (idempotent for a retried call); prune old ones."""
    body = {"max_staleness": policy.max_staleness, "eta_mode": policy.eta_mode,
            "epoch": policy.epoch, "at": time.time()}
    storage.makedirs(POLICY_DIR)
    try:
        storage.publish(_key(policy.epoch), records.encode(Kind.STATE, body))
    except AlreadyExists:
        pass  # this epoch's policy stands (a retried start of the same collector)
    for old in POLICIES.prune(storage.list(POLICY_DIR), KEEP):
        storage.delete(f"{POLICY_DIR}/{old}")


def read_policy(storage: Storage) -> EtaPolicy | None:
    """The newest epoch's policy; None when none was published or it cannot be read (a
    warning: the claim-time check is then skipped, the batch-time one still applies)."""
    for epoch in reversed(_epochs(storage)):
        key = _key(epoch)
        try:
            meta = records.decode(storage.read(key), expect=Kind.STATE, name=key).meta
            return EtaPolicy.from_meta({**meta, "epoch": meta.get("epoch", epoch)})
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
