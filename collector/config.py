"""Configuration of the global batch collector: one frozen, keyword-only, validated dataclass.

Build it from a mapping with ``CollectorConfig.from_dict(data)`` (``strawq.config.Config``:
unknown keys are refused by name). Every field is documented where it is declared; the
admission rule these bounds feed is explained in ``strawq.collector.admission`` and
``docs/collector.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from strawq.config import Config
from strawq.errors import ConfigError
from strawq.tasks.eta import DEFAULT_ETA_MODE, DEFAULT_MAX_STALENESS, EtaMode
from strawq.tasks.eta import MODES as ETA_MODES

__all__ = ["ADVANTAGE_MODES", "ETA_MODES", "AdvantageMode", "CollectorConfig", "EtaMode"]

AdvantageMode = Literal["grpo", "grpo_mean_only", "none"]
ADVANTAGE_MODES: tuple[str, ...] = get_args(AdvantageMode)


@dataclass(frozen=True, kw_only=True)
class CollectorConfig(Config):
    #: B: groups per training batch (one manifest).
    batch_groups: int = 64
    #: η: maximum staleness in weight versions (the version a group is trained at − its
    #: minimum token version). Bounded by default (``strawq.tasks.eta.DEFAULT_MAX_STALENESS``,
    #: 1): the admission window then keeps every group within η, and the rare one that
    #: still runs past it (a tail longer than η trainer steps) is handled by ``eta_mode``,
    #: counted and logged. ``None`` means unbounded (η = ∞): only the slot and backlog
    #: bounds apply, and nothing limits how stale a trained group is.
    max_staleness: int | None = DEFAULT_MAX_STALENESS
    #: What to do with a ready group that would be trained staler than η (docs/design.md,
    #: invariant 10; the staleness is projected to the version it is trained at, prefetched
    #: batches ahead of it counted): ``hard`` (the default: η is a hard bound — a batch is
    #: held back until every group that would otherwise miss η is in it, so the trainer
    #: waits for the tail instead of training it late, ``strawq.collector.deadlines``;
    #: nothing is dropped or regenerated; a group the hold still cannot place in time, with
    #: a window above (η + 1)·u or after a restart, is trained and counted as under
    #: ``train``), ``train`` (soft: keep the work, train it with its per-token importance
    #: correction, count it in ``collector/stale_trained_total``, name it in the manifest's
    #: ``over_eta`` and log a warning), ``regenerate`` (generated again from scratch, with a
    #: fresh sampling seed and a counted attempt; ``requeue`` is another name for it),
    #: ``drop`` (recorded in ``dropped/`` with reason ``stale_eta``), or ``off`` (admission
    #: control only, never checked on ready groups). Only ``regenerate`` and ``drop`` lose
    #: work, and only when configured.
    eta_mode: EtaMode = DEFAULT_ETA_MODE
    #: Optimizer steps (batches) per weight version; the admission bound scales with it.
    batches_per_version: int = 1
    #: The η admission window in batches (≥ 1, may be fractional): release while
    #: ``untrained + running < (admission_batches − T)·B``, T the batches being trained on
    #: the current version. None (the default) is ``(η + 1)·batches_per_version``: every
    #: admitted group is trained within η versions of its first token, whatever the order
    #: in which the trainer updates, checkpoints and acks. A larger window trades staleness
    #: for throughput (a group over η is then handled by ``eta_mode`` and counted). Ignored
    #: when η is None. See ``strawq.collector.admission``.
    admission_batches: float | None = None
    #: Bound on running groups (pending + leased + partial). Set it to the producers' total
    #: group slots K (docs/design.md, "Sizing") plus a small prefetch so no producer waits
    #: for work.
    max_running: int = 256
    #: Bound on the ready backlog: the collector releases only while
    #: ``ready + running < max_running + max_ready``.
    max_ready: int = 256
    #: Prefetched batches: manifests published but not yet acked by the trainer.
    max_prefetch_batches: int = 2
    #: Publish a short final batch once the dataset is exhausted and nothing is running.
    flush_at_end: bool = True
    #: Advantages stored in the manifest: ``grpo`` ((r − mean) / (std + eps), unbiased std
    #: over the group, as verl's GRPO), ``grpo_mean_only`` (r − mean, Dr. GRPO) or ``none``.
    advantages: AdvantageMode = "grpo"
    #: ε of the GRPO normalisation.
    advantage_eps: float = 1e-6
    #: Seconds between loop passes of ``Collector.run``.
    poll_interval_s: float = 0.05
    #: Seconds between GC passes over acked batches.
    gc_interval_s: float = 1.0
    #: Share of the volume under which the collector warns that the run's disk runs low
    #: (free space or inodes; checked every sweep, ``SWEEP_INTERVAL_S``): early enough to
    #: ``strawq gc`` or raise the quota before writes fail. 0: no warning until it is full.
    disk_warn_share: float = 0.05
    #: Collector heartbeat silence (on the newcomer's monotonic clock) after which a new
    #: collector takes over with epoch + 1 (at once if the holder's process on this host is
    #: gone). Must be far above one loop pass: the holder beats once per pass.
    takeover_timeout_s: float = 30.0
    #: Once the run has drained (every batch acked), how long ``Collector.run`` waits for
    #: the trainer's last checkpoint commit before it exits (the batches it would collect
    #: stay ``batched`` until then), seconds. Only a checkpointing trainer commits.
    finish_wait_s: float = 600.0
    #: Write one JSON line of queue metrics per this many seconds (0: every pass).
    metrics_interval_s: float = 10.0
    #: JSONL file the collector appends metrics to (None: no file).
    metrics_jsonl: str | None = None
    #: Port of the collector's Prometheus endpoint (None: no endpoint; 0: any free port).
    prometheus_port: int | None = None
    #: Address the Prometheus endpoint binds (127.0.0.1: this machine only; ``0.0.0.0``
    #: every interface: the metrics are readable by anyone who reaches the port).
    prometheus_host: str = "127.0.0.1"
    #: The trainer's data-parallel world size W, to pack each batch's W rank shards in the
    #: collector (``strawq.delivery.packed``): before publishing a manifest the collector reads its
    #: groups' records and writes one PACKED record per rank holding exactly what
    #: ``BatchReader.load`` would pack, and each rank of a W-rank trainer loads its shard
    #: with one read. Costs the collector a read of every record of the batch and a write
    #: of ~1.4x their bytes per batch (docs/benchmarks.md); a reader of another world size
    #: reads the records as without it. None (the default): no shards.
    pack_ranks: int | None = None

    def validate(self) -> None:
        if self.batch_groups < 1:
            raise ConfigError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0 or None (unbounded), got "
                              f"{self.max_staleness}")
        if self.batches_per_version < 1:
            raise ConfigError(f"batches_per_version must be >= 1, got "
                              f"{self.batches_per_version}")
        if self.admission_batches is not None and not (
                1 <= self.admission_batches < float("inf")):  # also refuses NaN
            raise ConfigError(f"admission_batches must be >= 1 (room for one full batch) or "
                              f"None, got {self.admission_batches}")
        if self.max_running < 1:
            raise ConfigError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_ready < self.batch_groups:
            raise ConfigError(f"max_ready ({self.max_ready}) must be >= batch_groups "
                              f"({self.batch_groups}), or no full batch can ever form")
        if self.max_prefetch_batches < 1:
            raise ConfigError(f"max_prefetch_batches must be >= 1, got "
                              f"{self.max_prefetch_batches}")
        if self.advantage_eps <= 0:
            raise ConfigError(f"advantage_eps must be > 0, got {self.advantage_eps}")
        for name in ("poll_interval_s", "gc_interval_s", "metrics_interval_s",
                     "finish_wait_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.disk_warn_share < 1:
            raise ConfigError(f"disk_warn_share must be in [0, 1) (a share of the volume), "
                              f"got {self.disk_warn_share}")
        if self.takeover_timeout_s <= 0:
            raise ConfigError(f"takeover_timeout_s must be > 0, got {self.takeover_timeout_s}")
        if self.pack_ranks is not None and self.pack_ranks < 1:
            raise ConfigError(f"pack_ranks must be >= 1 (the trainer's data-parallel world "
                              f"size) or None (no packed shards), got {self.pack_ranks}")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port < 65536:
            raise ConfigError(f"prometheus_port must be in [0, 65535] or None, got "
                              f"{self.prometheus_port}")
