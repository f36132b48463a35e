"""Metrics with the field's names: a JSONL line per step and a Prometheus endpoint.

Names (slash-separated, as slime and verl log them; Prometheus gets ``strawq_`` + the name
with ``/`` and ``.`` turned into ``_``):

* ``staleness/mean``, ``staleness/max``, ``staleness/multi_version_frac`` — over the samples
  of one batch: staleness = current version − the sample's minimum token version
  (``strawq.ondisk.groups.staleness``, per sample);
  multi-version = the sample's response tokens carry more than one version.
* ``trainer/wait_ratio`` — time spent waiting in ``next_batch`` ÷ step time (from one
  ``next_batch`` return to the next).
* ``queue/pending``, ``queue/partial``, ``queue/leased``, ``queue/ready``, ``queue/batched``,
  ``queue/prefetched_batches``, ``queue/version``.
* ``collector/groups_per_s`` (groups that became ready per second), ``collector/released``
  (this pass), ``collector/admission_capacity``, ``dropped/<reason>`` (groups dropped per
  reason, over the whole run).
* ``dataset/pass`` (the pass over the dataset, 0 first: ``queue.num_epochs``).
* with a dataset mixture, per dataset ``dataset/<name>/``: ``weight``, ``group_share``,
  ``token_share`` (the last 8 batches), ``group_share_total``, ``token_share_total``,
  ``trained_groups_total``, ``trained_tokens_total``, ``filtered_total``, ``stale_total``,
  ``starved`` and ``starved_reason`` (``strawq.collector.mixing``; this collector's run).
* counters: ``trainer/step``, ``collector/step``, ``collector/released_total``,
  ``collector/batches_total``, ``collector/expired_leases_total``,
  ``collector/skipped_zero_variance_total`` (rows the history's rule skipped),
  ``attest/checks_total``, ``attest/failures_total`` (engines checked against a published
  fingerprint, and those that failed: ``WeightUpdateBracket.attestation_metrics``, with
  ``attest/last_s``, the seconds of the last round of checks), ``attest/unreachable_total``
  (engines that did not answer a check: not checked, out of rotation).

Every JSONL line carries ``time`` (Unix seconds, the writer's wall clock) so lines from the
collector and the trainer can be put on one time axis.

Counters (``COUNTERS``: ``trainer/step``, ``collector/step`` and the ``*_total`` names)
continue across restarts: a sink reads the newest value of each from the tail of its JSONL
file when it opens and adds it to what the new process counts. ``dropped/<reason>`` is
read from the run itself (``strawq.delivery.retention.drop_totals``) and needs no such help.

Prometheus series follow its conventions (``strawq.views.prom``: counters typed ``counter`` with
``_total``, keys as labels, a ``run`` label on every series, HELP sentences); each sink has
its own registry so several sinks in one process do not collide. ``prometheus_client`` (a
dependency of Ray, present in the venv) is imported only when an endpoint is asked for.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from strawq.views.prom import Exposition, prom_name

log = logging.getLogger(__name__)

__all__ = ["COUNTERS", "MetricsSink", "dropped_metric", "prom_name", "resume_counters"]


#: Cumulative counts that continue across restarts (see the module docstring).
COUNTERS = frozenset({"trainer/step", "collector/step", "collector/released_total",
                      "collector/batches_total", "collector/expired_leases_total",
                      "collector/skipped_zero_variance_total", "attest/checks_total",
                      "attest/failures_total", "attest/unreachable_total"})
#: How much of the JSONL file's tail is read to resume the counters.
_TAIL_BYTES = 256 * 1024


def dropped_metric(reason: str) -> str:
    """The metric counting groups dropped with ``reason`` over the run (a metric name, not
    a storage key)."""
    return f"dropped/{reason}"


def _end_torn_line(path: str) -> None:
    """A crash can leave a last line without its newline: end it so ours parse."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    except OSError:
        return
    if torn:
        with open(path, "ab") as f:
            f.write(b"\n")


def resume_counters(path: str) -> dict[str, float]:
    """The newest value of each counter in the tail of a metrics JSONL file ({} if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - _TAIL_BYTES, 0))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, float] = {}
    for line in reversed(tail.splitlines()):
        try:
            values = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line, or the cut at the start of the tail
        if not isinstance(values, dict):
            continue
        for name in COUNTERS - found.keys():
            v = values.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                found[name] = v
        if len(found) == len(COUNTERS):
            break
    return found


class MetricsSink:
    """Appends JSON lines and mirrors numeric values into a Prometheus endpoint.

    ``labels``: constant labels on every series (the collector and the reader give
    ``{"run": ...}``, ``strawq.views.status.run_label``)."""

    def __init__(self, jsonl_path: str | None = None, prometheus_port: int | None = None,
                 *, addr: str = "127.0.0.1", labels: Mapping[str, str] | None = None) -> None:
        self.jsonl_path = jsonl_path
        self._lock = threading.Lock()
        self.exposition: Exposition | None = None
        self.port: int | None = None
        #: counters' values at the end of the previous incarnation (same JSONL file)
        self.base: dict[str, float] = {}
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self.base = resume_counters(jsonl_path)
            _end_torn_line(jsonl_path)
        if prometheus_port is not None:
            self.exposition = Exposition(labels)
            self.port = self.exposition.serve(prometheus_port, addr)

    def emit(self, values: Mapping[str, Any]) -> None:
        """Write one JSON line (if configured) and update the endpoint's numeric values.

        Adds ``time`` and continues the counters of a previous incarnation.
        """
        out: dict[str, Any] = {**values, "time": values.get("time", time.time())}
        for name in COUNTERS & out.keys():
            if name in self.base and isinstance(out[name], (int, float)):
                out[name] = out[name] + self.base[name]
        values = out
        if self.jsonl_path:
            line = json.dumps(dict(values), sort_keys=True, default=str) + "\n"
            with self._lock:
                fd = os.open(self.jsonl_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
        if self.exposition is not None:
            self.exposition.update(values)

    def close(self) -> None:
        if self.exposition is not None:
            self.exposition.close()
