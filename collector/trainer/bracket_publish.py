"""What a weight update publishes besides the bracket's control records: the rolling mode's
weights and manifest (``strawq.weights.publish``), and the fingerprint engines are attested
against (``strawq.weights.fingerprint``). ``WeightUpdateBracket`` composes one
:class:`UpdatePublisher`; rank 0 only, as the bracket."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from strawq.errors import BracketError
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control
from strawq.weights.delta import MAX_DELTA_CHAIN, Staged, stage, sweep
from strawq.weights.fingerprint import Fingerprint, Fingerprints
from strawq.weights.publish import Manifest, WeightStore, check_mode, wave_width

log = logging.getLogger(__name__)


class UpdatePublisher:
    """The update's mode (``"bracket"``: pause every producer, push, resume; ``"rolling"``:
    publish the weights once and return, engines pull them in waves), its rolling settings,
    and the fingerprints published for attestation."""

    def __init__(self, queue: RunQueue, *, mode: str = "bracket", wave: float = 0.25,
                 max_lag: int = 1, attest: bool = True,
                 max_delta_chain: int = MAX_DELTA_CHAIN,
                 publish_dir: str | None = None) -> None:
        check_mode(mode, wave, max_lag)
        if max_delta_chain < 0:
            raise ValueError(f"max_delta_chain must be >= 0, got {max_delta_chain}")
        self.queue = queue
        self.mode = mode
        #: rolling: engines that may load a version at once (>= 1 a count, < 1 a share of
        #: the known engines), and versions an engine may lag the newest and still serve
        self.wave = wave
        self.max_lag = int(max_lag)
        self.weights = WeightStore(queue.storage)
        #: check every engine against a published fingerprint before resuming producers
        #: (a version without one is not checked)
        self.attest = attest
        #: rolling: a directory every engine reads, where each version's weights are
        #: copied, whole or as a delta against the version before (``strawq.weights.
        #: delta``); ``write(v)`` may then write to the trainer's local disk. None: the
        #: directory ``write(v)`` returns is published as it is, always full
        self.publish_dir = publish_dir
        #: deltas in a row before the next publish is full again (0: always full)
        self.max_delta_chain = int(max_delta_chain)

    def fingerprint(self, version: int, fingerprint: Fingerprint) -> None:
        """Record the fingerprint of the weights published as ``version``."""
        if self.attest:
            Fingerprints(self.queue.storage).publish(version, fingerprint)

    def rolling(self, write: Callable[[int], Any], *, version: int | None, open_version:
                int | None, control: Control, fleet: int,
                clock: Callable[[], float] = time.monotonic,
                fingerprint: Fingerprint | None = None) -> tuple[int, Manifest, float]:
        """The rolling mode's update: ``write(v)`` writes version v's weights and returns
        their directory; the manifest is published and v announced. Refused while a bracket
        is open. Returns (v, manifest, seconds spent).

        With ``fingerprint`` (and ``attest``), it is recorded as v's first, before
        ``write(v)`` and so before the manifest that lets engines load v: an engine can
        load v only once v's fingerprint exists, and is checked against it
        (``strawq.producers.rolling``)."""
        st = control.state()
        if open_version is not None or st.paused:
            raise BracketError(f"publish_weights: the weight-update bracket for version "
                               f"{st.pause_version} is open; finish or abort it first")
        now = self.queue.current_version()
        target = max(now, st.resume_version) + 1 if version is None else int(version)
        if target <= now:
            raise BracketError(f"publish_weights({target}): the run is at version {now} "
                               "already")
        if fingerprint is not None:
            self.fingerprint(target, fingerprint)
        m, waited = self.weights.publish_version(
            target, self._staging(write), announce=self.queue.set_version,
            wave=wave_width(self.wave, fleet), max_lag=self.max_lag, clock=clock)
        if self.publish_dir is not None:
            sweep(self.publish_dir, [k.path for k in self.weights.kept()])
        return target, m, waited

    def _staging(self, write: Callable[[int], Any]) -> Callable[[int], Any]:
        """``write``, then (with a ``publish_dir``) its weights copied there, whole or as a
        delta against the newest published version; a version already published is not
        copied again."""
        if self.publish_dir is None:
            return write
        publish_dir = self.publish_dir

        def staged(version: int) -> Staged | str | None:
            path = write(version)
            if path is None:
                return None
            there = self.weights.manifest(version)
            if there is not None:  # a retry: publish() keeps it or refuses other weights
                return str(path)
            newest = self.weights.newest()
            base = newest.as_base() if newest is not None and newest.version < version \
                else None
            return stage(version, path, publish_dir, base=base,
                         max_delta_chain=self.max_delta_chain)

        return staged
