"""A producer's own Prometheus endpoint (``strawq producer --prometheus-port``).

Series read from ``Producer.stats()`` at each scrape, named by ``strawq.views.prom`` with the
constant labels ``run`` and ``producer``: each count of ``ProducerStats`` is a counter
``strawq_producer_<count>_total`` (``tokens_generated`` as SGLang names it,
``strawq_producer_generation_tokens_total``); the present-tense values are gauges
(``strawq_producer_slots``, ``_busy_trajectories``, ``_slot_utilisation``, ``_engines_stale``,
``_paused``, ``_idle``, ``_heartbeat_failing``, ``_waiting_for_weights``, ``_wall_seconds``,
``_cpu_seconds``), and ``strawq_producer_dropped_groups_total{reason}`` counts its drops.
The collector exports what it sees of every producer (heartbeat age, up): see
``strawq.collector.ops_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from strawq.views.prom import Exposition

#: ``ProducerStats`` fields that are a value now, not a count.
GAUGES = frozenset({"slots", "group_size", "busy_trajectories", "engines_stale", "paused",
                    "idle", "heartbeat_failing", "waiting_for_weights", "wall_s", "cpu_s",
                    "slot_utilisation", "cpu_s_per_group"})
#: Counts named as the engines' own metrics name them.
RENAMED = {"tokens_generated": "generation_tokens"}


def producer_values(stats: Mapping[str, Any]) -> dict[str, Any]:
    """``ProducerStats.to_dict()`` as metric names (``producer/...``); text and lists left
    out."""
    out: dict[str, Any] = {}
    for k, v in stats.items():
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)) or k == "groups_done":
            continue
        name = RENAMED.get(k, k)
        out[f"producer/{name}" if k in GAUGES else f"producer/{name}_total"] = v
    for reason, n in (stats.get("drop_reasons") or {}).items():
        out[f"producer_dropped/{reason}"] = n
    return out


def serve_producer_metrics(stats: Callable[[], Mapping[str, Any]], *, run: str, producer: str,
                           port: int, host: str = "127.0.0.1") -> Exposition:
    """Serve a producer's metrics on ``host:port`` (0: any free port); ``close()`` it."""
    exp = Exposition({"run": run, "producer": producer},
                     source=lambda: producer_values(stats()))
    exp.serve(port, host)
    return exp
