"""The rollout schedules, driven from the trainer's side of the reader API.

* ``sync`` — a synchronous barrier: admission lets exactly one batch of groups into flight
  (η = 0, at most B groups running or untrained); the trainer waits for all of them, and
  generation is paused while it trains.
* ``partial`` — synchronous with partial rollout (APRIL): admission over-samples
  (``oversample``·B groups in flight); the step starts as soon as B groups are ready, the
  rest are interrupted by the bracket and persisted as partial tasks that resume first in
  the next step. Generation is paused while the trainer trains.
* ``async`` — fully asynchronous with staleness bound η: producers keep generating while
  the trainer trains; the bracket interrupts them only for the weight push (interrupted
  samples resume on the new weights: partial resume across updates); admission keeps
  ``(η + 1)·B`` groups untrained or running, and a group that still ends up over η is
  trained with its importance correction and counted, never dropped or regenerated.
* ``stream`` — ``async`` whose step is ``micro_batches`` micro-batches of B/m complete
  groups, each trained as soon as it is ready (gradient accumulation; one weight version
  per step): the trainer starts on the first groups that finish instead of waiting for B,
  and groups that finish while a step runs are trained in that same step, on the version
  that generated them (staleness 0). Staleness-first order still holds within the stream.
* ``flow`` — ``stream`` whose micro-batches are acknowledged as soon as they are trained.
  Admission counts what was trained, not what was acked (``strawq.collector.admission``):
  a micro-batch delivered on the current version holds its room until the update, so flow
  gets stream's window, ``(η + 1)·m`` micro-batches, and keeps η the same way. The
  checkpoint still covers whole steps: an acked micro-batch stays on disk until a commit
  covers it, and a restarted trainer is delivered the whole step again.

The loop records a timeline (trainer wait / train / weight update intervals) for plots.
When the trainer gives the fingerprint of the weights it pushed (``fingerprint()``), the
bracket's update publishes it for the new version: every engine is attested before
producers resume (``strawq.weights.fingerprint``). The rolling update publishes none.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strawq.collector.config import CollectorConfig
from strawq.collector.trainer.bracket import WeightUpdateBracket
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.config import Config
from strawq.demo.trainer import TrainerBackend
from strawq.errors import ConfigError
from strawq.ondisk.groups import staleness
from strawq.tasks.eta import DEFAULT_ETA_MODE, MODES as ETA_MODES

log = logging.getLogger(__name__)

MODES = ("sync", "partial", "async", "stream", "flow")
#: modes that train a step as micro-batches
STREAMING = ("stream", "flow")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig(Config):
    mode: str = "async"
    #: groups per training batch (B)
    batch_groups: int = 8
    #: training steps (one weight version each)
    steps: int = 20
    #: async: staleness bound η in versions
    max_staleness: int = 1
    #: what η means (``CollectorConfig.eta_mode``): ``hard`` (the default: a batch waits for
    #: the groups due by its version) or ``train`` (soft: over-η groups trained and counted)
    eta_mode: str = DEFAULT_ETA_MODE
    #: partial: groups admitted per batch (≥ 1)
    oversample: float = 1.5
    #: total producer group slots K (caps running groups)
    slots: int = 64
    #: stream, flow: micro-batches per step (B must be a multiple)
    micro_batches: int = 4
    #: async, stream, flow: the admission window in micro-batches
    #: (``CollectorConfig.admission_batches``; None: ``(η + 1)·m``, which keeps η)
    admission_batches: float | None = None
    #: deadline of one next_batch / bracket wait
    timeout_s: float = 600.0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.batch_groups < 1 or self.steps < 1 or self.slots < 1:
            raise ConfigError("batch_groups, steps and slots must be >= 1")
        if self.max_staleness < 0 or self.oversample < 1:
            raise ConfigError("max_staleness must be >= 0 and oversample >= 1")
        if self.eta_mode not in ETA_MODES:
            raise ConfigError(f"eta_mode must be one of {list(ETA_MODES)}, got "
                              f"{self.eta_mode!r}")
        if self.mode in STREAMING and (self.micro_batches < 1
                                       or self.batch_groups % self.micro_batches):
            raise ConfigError(f"micro_batches ({self.micro_batches}) must be >= 1 and divide "
                              f"batch_groups ({self.batch_groups})")

    @property
    def per_step(self) -> int:
        """Manifests (batches) the trainer reads per step: one, or the micro-batches."""
        return self.micro_batches if self.mode in STREAMING else 1

    @property
    def acks_micro_batches(self) -> bool:
        """Each micro-batch is acknowledged as soon as it is trained (``flow``)."""
        return self.mode == "flow"


def collector_config(cfg: ScheduleConfig, **extra: Any) -> CollectorConfig:
    """The collector settings that implement a schedule."""
    b = cfg.batch_groups
    per_step = cfg.per_step
    if cfg.mode == "sync":
        running, eta = b, 0
    elif cfg.mode == "partial":
        # APRIL bounds nothing but the over-sampling: an interrupted group resumes first in
        # the next step however many steps it spans. With eta = 1 a group needing more than
        # two steps' generation (a long tail at the cap) was re-queued from scratch, and as
        # its seed is fixed, again every time (strawq lab: 95 re-queued groups in 8 steps).
        running, eta = max(b, math.ceil(cfg.oversample * b)), None
    else:
        # Producers count K in trajectories: a group waiting on one long sample holds one
        # trajectory, so they can hold more than K groups at once. A bound of K running
        # groups starved them (strawq lab: engines 30 % busy, trainer waiting 60 %); K + B
        # leaves a batch of claimable work, and the eta bound ((eta + 1)·B groups untrained
        # or running) stays the one that limits staleness.
        running, eta = cfg.slots + b, cfg.max_staleness
    # eta_mode "hard" (the default): a batch waits for the groups due by its version, so the
    # trainer waits for a tail longer than eta trainer steps instead of training it late;
    # "train": such a group is trained and counted. Neither regenerates or drops anything
    # for staleness (docs/design.md, invariant 10).
    # None: (eta + 1)·m micro-batches, whatever the ack order (what was trained counts)
    window = cfg.admission_batches if cfg.mode in ("async", *STREAMING) else None
    return CollectorConfig(batch_groups=b // per_step, batches_per_version=per_step,
                           max_staleness=eta, eta_mode=cfg.eta_mode,  # type: ignore[arg-type]
                           admission_batches=window,
                           max_running=running, max_ready=max(2 * b, running),
                           max_prefetch_batches=per_step, **extra)


@dataclass
class Interval:
    what: str
    start: float
    end: float


@dataclass
class StepRecord:
    step: int
    version: int
    wait_s: float
    train_s: float
    update_s: float
    metrics: dict[str, float]
    #: per sample: version trained on - the sample's oldest token version
    staleness: list[int] = field(default_factory=list)
    #: dataset indices of the samples' prompts (one per group)
    indices: list[int] = field(default_factory=list)
    #: per sample: response length (tokens), aligned with ``staleness``
    lengths: list[int] = field(default_factory=list)
    #: the rolling update: the seconds the trainer took to write this step's weights once
    #: (its manifest's ``write_s``; None: the global bracket)
    write_s: float | None = None


@dataclass
class ScheduleResult:
    records: list[StepRecord] = field(default_factory=list)
    intervals: list[Interval] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    def trainer_wait_ratio(self) -> float:
        wait = sum(r.wait_s for r in self.records)
        return wait / self.wall_s if self.wall_s > 0 else float("nan")


def run_schedule(cfg: ScheduleConfig, reader: BatchReader, bracket: WeightUpdateBracket,
                 trainer: TrainerBackend, *, start_version: int = 0, start_step: int = 0,
                 on_step: Callable[[StepRecord], None] | None = None,
                 checkpoint: Callable[[StepRecord, Batch], None] | None = None,
                 should_stop: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic) -> ScheduleResult:
    """Train ``cfg.steps`` steps; every step is one new weight version pushed to engines.

    ``checkpoint(record, batch)`` runs after the new weights are pushed and *before* the
    batch is acknowledged, so a crash anywhere leaves either a checkpoint that counts the
    batch (the reader skips it on resume) or an unacknowledged batch that is delivered
    again to a trainer restored from the previous checkpoint: trained exactly once.
    """
    res = ScheduleResult(started=clock())
    version = start_version
    for step in range(start_step, cfg.steps):
        if should_stop():
            break
        rec = _one_step(cfg, step, version, reader, bracket, trainer, res, checkpoint, clock)
        version = rec.version
        res.records.append(rec)
        if on_step is not None:
            on_step(rec)
    res.ended = clock()
    return res


def _merge(metrics: list[dict[str, float]], sizes: list[int]) -> dict[str, float]:
    """Micro-batch metrics as one step's: ``tokens`` summed, the rest sample-weighted."""
    if len(metrics) == 1:
        return metrics[0]
    total = max(sum(sizes), 1)
    out: dict[str, float] = {}
    for key in {k for m in metrics for k in m}:
        vals = [(m.get(key, 0.0), n) for m, n in zip(metrics, sizes, strict=True)]
        if key in ("tokens", "train_s"):
            out[key] = sum(v for v, _ in vals)
        elif key.endswith("/max"):
            out[key] = max(v for v, _ in vals)
        else:
            out[key] = sum(v * n for v, n in vals) / total
    return out


def _one_step(cfg: ScheduleConfig, step: int, version: int, reader: BatchReader,
              bracket: WeightUpdateBracket, trainer: TrainerBackend, res: ScheduleResult,
              checkpoint: Callable[[StepRecord, Batch], None] | None,
              clock: Callable[[], float]) -> StepRecord:
    pause_while_training = cfg.mode in ("sync", "partial")
    wait = train = pause = 0.0
    metrics: list[dict[str, float]] = []
    stal: list[int] = []
    idx: set[int] = set()
    lengths: list[int] = []
    batches: list[Batch] = []
    for _micro in range(cfg.per_step):
        t0 = clock()
        batch = reader.next_batch(timeout=cfg.timeout_s)
        t1 = clock()
        res.intervals.append(Interval("wait", t0, t1))
        if pause_while_training:
            bracket.begin_weight_update(timeout=cfg.timeout_s)
        t2 = clock()
        metrics.append(trainer.train_step(batch))
        t3 = clock()
        res.intervals.append(Interval("train", t2, t3))
        wait, train, pause = wait + t1 - t0, train + t3 - t2, pause + t2 - t1
        # version trained on: the weights before this step's update (read-time staleness)
        stal += staleness(version, batch.sample_min_version.numpy()).clip(min=0).tolist()
        idx |= {int(s["index"]) for s in batch.summaries}
        lengths += batch.response_lens.tolist()
        batches.append(batch)  # acked with the step: a crash re-delivers the whole step
        if cfg.acks_micro_batches:  # frees its admission room now; a commit covers it later
            reader.ack(batch)
    t3 = clock()
    if not pause_while_training and bracket.mode == "rolling":
        # the rolling update: publish once and go on; engines load it in waves
        rep = bracket.publish_weights(trainer.write_weights)
        version = rep.version
        sizes = [b.num_samples for b in batches]
        rec = StepRecord(step, version, wait, train, 0.0, _merge(metrics, sizes), stal,
                         sorted(idx), lengths,
                         write_s=rep.published.write_s if rep.published is not None else None)
        if checkpoint is not None:
            checkpoint(rec, batches[-1])
        for b in batches:
            if not cfg.acks_micro_batches:
                reader.ack(b)
        t4 = clock()
        res.intervals.append(Interval("update", t3, t4))
        rec.update_s = t4 - t3
        return rec
    if not pause_while_training:
        bracket.begin_weight_update(timeout=cfg.timeout_s)
    version += 1
    trainer.push_weights(version)
    fp = trainer.fingerprint()
    if fp is not None:  # end_weight_update attests every engine against it
        bracket.publish_fingerprint(version, fp)
    sizes = [b.num_samples for b in batches]
    rec = StepRecord(step, version, wait, train, 0.0, _merge(metrics, sizes), stal, sorted(idx),
                     lengths)
    if checkpoint is not None:
        checkpoint(rec, batches[-1])
    if pause_while_training:
        for b in batches:  # producers are paused: freed groups start on the new version
            reader.ack(b)
        bracket.end_weight_update(version)
    else:
        # async: acknowledge once the new version is live (the η projection does not
        # depend on it: a delivered batch counts as trained, acked or not)
        bracket.end_weight_update(version)
        for b in batches:
            if not cfg.acks_micro_batches:
                reader.ack(b)
    t4 = clock()
    res.intervals.append(Interval("update", t3, t4))
    rec.update_s = (t4 - t3) + pause
    return rec
