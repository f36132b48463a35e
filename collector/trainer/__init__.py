"""The trainer-side library: what a trainer process imports to train on strawq's batches.

* ``strawq.collector.trainer.reader`` — ``BatchReader`` (this rank's shard of each published
  batch, acks, commits, the checkpoint state) and ``Batch``;
* ``strawq.collector.trainer.packing`` — rank sharding and shard packing, over the record
  reads of ``strawq.collector.trainer.record_io`` (the collector process packs the rank
  shards with them too);
* ``strawq.collector.trainer.bracket`` — ``WeightUpdateBracket``, the weight-update bracket;
* ``strawq.collector.trainer.importance`` — token-level importance sampling and the loss
  aggregations (``LossTotals``, ``aggregate_loss``, ``batch_loss``);
* ``strawq.collector.trainer.behaviour`` — the behaviour policy's sampling columns and the
  read-time staleness;
* ``strawq.collector.trainer.metrics`` — ``MetricsSink`` (JSONL + Prometheus), shared with
  the collector process.

The library sits on the core only: it never imports the collector process
(``strawq.collector.core``, ``admission``, ``ordering``, ``fencing``, ``resume``,
``mixing``, ``cli``, ``config``, ``errors``); what both sides need lives in the core
(``strawq.tasks.epochs``, ``strawq.delivery.checkpoint``, ``strawq.errors``). The integrations
(``strawq.collector.integrations``) sit on it. Nothing is imported here: the collector
process imports ``packing`` and ``metrics`` from this package and must not import torch,
which ``reader`` and ``importance`` do. Import the modules by their full names.
"""

from __future__ import annotations
