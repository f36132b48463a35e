"""Metrics with the field's names: a JSONL line per step and a Prometheus endpoint.

Names (slash-separated, as slime and verl log them; Prometheus gets ``strawq_`` + the name
with ``/`` and ``.`` turned into ``_``):

* ``staleness/mean``, ``staleness/max``, ``staleness/multi_version_frac`` — over the samples
  of one batch: staleness = current version − the sample's minimum token version
  (``strawq.groups.staleness``, per sample);
  multi-version = the sample's response tokens carry more than one version.
* ``trainer/wait_ratio`` — time spent waiting in ``next_batch`` ÷ step time (from one
  ``next_batch`` return to the next).
* ``queue/pending``, ``queue/partial``, ``queue/leased``, ``queue/ready``, ``queue/batched``,
  ``queue/prefetched_batches``, ``queue/version``.
* ``collector/groups_per_s`` (groups that became ready per second), ``collector/released``,
  ``collector/admission_capacity``, ``dropped/<reason>`` (groups dropped per reason).

Prometheus uses ``prometheus_client`` (a dependency of Ray, present in the venv); each sink
has its own registry so several sinks in one process do not collide.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

_PROM_NAME = re.compile(r"[^a-zA-Z0-9_]")


def prom_name(name: str) -> str:
    return "strawq_" + _PROM_NAME.sub("_", name)


class MetricsSink:
    """Appends JSON lines and mirrors numeric values into Prometheus gauges."""

    def __init__(self, jsonl_path: str | None = None, prometheus_port: int | None = None,
                 *, addr: str = "0.0.0.0") -> None:
        self.jsonl_path = jsonl_path
        self._lock = threading.Lock()
        self._registry: Any = None
        self._gauges: dict[str, Any] = {}
        self._server: Any = None
        self.port: int | None = None
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
        if prometheus_port is not None:
            self._start_prometheus(prometheus_port, addr)

    def _start_prometheus(self, port: int, addr: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._registry = CollectorRegistry()
        result = start_http_server(port, addr=addr, registry=self._registry)
        if isinstance(result, tuple):  # prometheus_client >= 0.20 returns (server, thread)
            self._server = result[0]
            self.port = int(self._server.server_port)
        else:
            self.port = port
        log.info("metrics: Prometheus endpoint on %s:%s", addr, self.port)

    def emit(self, values: Mapping[str, Any]) -> None:
        """Write one JSON line (if configured) and update the gauges of numeric values."""
        if self.jsonl_path:
            line = json.dumps(dict(values), sort_keys=True, default=str) + "\n"
            with self._lock:
                fd = os.open(self.jsonl_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
        if self._registry is not None:
            self._update_gauges(values)

    def _update_gauges(self, values: Mapping[str, Any]) -> None:
        from prometheus_client import Gauge

        with self._lock:
            for name, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                g = self._gauges.get(name)
                if g is None:
                    g = Gauge(prom_name(name), name, registry=self._registry)
                    self._gauges[name] = g
                g.set(float(value))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
