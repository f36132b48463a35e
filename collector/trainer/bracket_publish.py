"""What a weight update publishes besides the bracket's control records: the rolling mode's
weights and manifest (``strawq.weights.publish``), and the fingerprint engines are attested
against (``strawq.weights.fingerprint``). ``WeightUpdateBracket`` composes one
:class:`UpdatePublisher`; rank 0 only, as the bracket."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from strawq.errors import BracketError
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control
from strawq.weights.fingerprint import Fingerprint, Fingerprints
from strawq.weights.publish import Manifest, WeightStore, check_mode, wave_width


class UpdatePublisher:
    """The update's mode (``"bracket"``: pause every producer, push, resume; ``"rolling"``:
    publish the weights once and return, engines pull them in waves), its rolling settings,
    and the fingerprints published for attestation."""

    def __init__(self, queue: RunQueue, *, mode: str = "bracket", wave: float = 0.25,
                 max_lag: int = 1, attest: bool = True) -> None:
        check_mode(mode, wave, max_lag)
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

    def fingerprint(self, version: int, fingerprint: Fingerprint) -> None:
        """Record the fingerprint of the weights published as ``version``."""
        if self.attest:
            Fingerprints(self.queue.storage).publish(version, fingerprint)

    def rolling(self, write: Callable[[int], Any], *, version: int | None, open_version:
                int | None, control: Control, fleet: int,
                clock: Callable[[], float] = time.monotonic) -> tuple[int, Manifest, float]:
        """The rolling mode's update: ``write(v)`` writes version v's weights and returns
        their directory; the manifest is published and v announced. Refused while a bracket
        is open. Returns (v, manifest, seconds spent)."""
        st = control.state()
        if open_version is not None or st.paused:
            raise BracketError(f"publish_weights: the weight-update bracket for version "
                               f"{st.pause_version} is open; finish or abort it first")
        now = self.queue.current_version()
        target = max(now, st.resume_version) + 1 if version is None else int(version)
        if target <= now:
            raise BracketError(f"publish_weights({target}): the run is at version {now} "
                               "already")
        m, waited = self.weights.publish_version(
            target, write, announce=self.queue.set_version, wave=wave_width(self.wave, fleet),
            max_lag=self.max_lag, clock=clock)
        return target, m, waited
