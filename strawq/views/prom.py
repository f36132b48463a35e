"""Prometheus exposition by its conventions, for every part that exports metrics.

strawq's metrics have slash-separated names (``queue/ready``, ``dropped/<reason>``), as slime
and verl log them. ``series`` maps one to a Prometheus series:

* ``strawq_`` + the name with ``/`` and ``.`` as ``_``, seconds spelled out
  (``trainer/wait_s`` -> ``strawq_trainer_wait_seconds``, ``collector/groups_per_s`` ->
  ``strawq_collector_groups_per_second``);
* a counter (``COUNTER_NAMES``, or a name ending ``_total`` that is not a share) is typed
  ``counter`` and its family ends ``_total`` (``trainer/step`` ->
  ``strawq_trainer_step_total``); everything else is a ``gauge``;
* a name that carries a key becomes a label: ``dropped/<reason>`` ->
  ``strawq_dropped_groups_total{reason=...}`` (``producer_dropped/<reason>``: one producer's,
  ``strawq_producer_dropped_groups_total``), ``dataset/<name>/<field>`` ->
  ``strawq_dataset_<field>{dataset=...}``, ``producer/<id>/<field>`` ->
  ``strawq_producer_<field>{producer=...}``; a share over the whole run
  (``dataset/<name>/group_share_total``) is a gauge named ``..._share_overall``;
* every series carries the exporter's constant labels (``run``, and ``producer`` on a
  producer's own endpoint);
* ``HELP`` is a sentence (``HELP``; a family it does not list gets one built from its name).

``Exposition`` holds the values (pushed with ``update``, or read at scrape time from a
``source``) in its own registry, so several in one process do not collide, and serves them
over HTTP (``serve``). It needs ``prometheus_client`` (a dependency of Ray) only when used.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_PROM_NAME = re.compile(r"[^a-zA-Z0-9_]")

#: Cumulative counts whose names do not end ``_total`` (steps taken).
COUNTER_NAMES = frozenset({"trainer/step", "collector/step"})

#: The label a keyed name's key becomes: ``dropped/<reason>``, ``dataset/<name>/<field>``...
_KEYED = {"dropped": "reason", "dataset": "dataset", "producer": "producer"}

#: HELP text per family (a sentence: what is counted, in which unit).
HELP: dict[str, str] = {
    # collector
    "strawq_collector_up": "1 while the run's collector process serves this endpoint.",
    "strawq_collector_step_total": "Passes the collector made over the run (continues across "
                                   "restarts).",
    "strawq_collector_epoch": "The collector's fencing epoch; it grows by one at each takeover.",
    "strawq_collector_released": "Prompts the collector released in its last pass.",
    "strawq_collector_released_total": "Prompts released from the dataset over the run.",
    "strawq_collector_batches_total": "Batches the collector published over the run.",
    "strawq_collector_expired_leases": "Leases that expired in the collector's last pass.",
    "strawq_collector_expired_leases_total": "Leases that expired over the run (their tasks "
                                             "were re-queued).",
    "strawq_collector_admission_capacity": "Prompts the admission control would release now.",
    "strawq_collector_groups_per_second": "Groups that became ready per second since the "
                                          "previous metrics line.",
    "strawq_collector_skipped_zero_variance_total": "Dataset rows the history's admission rule "
                                                    "skipped for a pass.",
    "strawq_collector_stale_trained_total": "Groups over the staleness bound that were trained "
                                            "anyway (eta_mode train).",
    "strawq_collector_stale_regenerated_total": "Groups over the staleness bound sent back to "
                                                "be generated again.",
    "strawq_collector_stale_dropped_total": "Groups over the staleness bound dropped.",
    # queue
    "strawq_queue_version": "The run's current weight version.",
    "strawq_queue_pending": "Tasks waiting to be claimed by a producer.",
    "strawq_queue_partial": "Tasks with partial groups saved, waiting to be resumed.",
    "strawq_queue_leased": "Tasks a producer holds a lease on.",
    "strawq_queue_ready": "Groups generated and waiting to be batched.",
    "strawq_queue_batched": "Groups in batches the trainer has not trained yet.",
    "strawq_queue_prefetched_batches": "Batches published and not yet acknowledged by the "
                                       "trainer.",
    "strawq_queue_quarantined": "Records moved to quarantine/ because they failed their checks.",
    "strawq_dropped_groups_total": "Groups dropped over the run, by reason.",
    "strawq_engines_needing_weights": "Engines out of rotation because they hold weights "
                                      "other than the run's.",
    "strawq_dataset_pass": "The pass over the dataset, 0 for the first.",
    # liveness
    "strawq_producer_up": "1 while the producer's heartbeat beats within the lease timeout "
                          "(idle producers included), 0 once it is silent longer.",
    "strawq_producer_idle": "1 while the producer's heartbeat carries the idle mark.",
    "strawq_producer_heartbeat_age_seconds": "Seconds since the producer's heartbeat counter "
                                             "last moved, on the collector's clock.",
    "strawq_producers_live": "Producers whose heartbeat moved within the liveness timeout and "
                             "that are not idle.",
    "strawq_producers_known": "Producers with a heartbeat file in the run.",
    "strawq_bracket_open": "1 while a weight-update bracket is open (producers paused).",
    "strawq_bracket_open_seconds": "Seconds the open weight-update bracket has been open, on "
                                   "the collector's clock (0 when none is open).",
    "strawq_bracket_unacked_producers": "Live producers the open bracket still waits for.",
    "strawq_disk_free_bytes": "Bytes an unprivileged writer may still use on the run's "
                              "filesystem.",
    "strawq_disk_free_ratio": "Share (0..1) of the run's filesystem still free.",
    # trainer
    "strawq_trainer_step_total": "Batches the trainer consumed over the run.",
    "strawq_trainer_wait_seconds": "Seconds the trainer waited for its last batch.",
    "strawq_trainer_wait_ratio": "Share of the last step the trainer spent waiting for data.",
    "strawq_staleness_mean": "Mean staleness (weight versions behind) of the last batch's "
                             "samples.",
    "strawq_staleness_max": "Largest staleness of the last batch's samples.",
    "strawq_staleness_multi_version_frac": "Share of the last batch's samples whose tokens "
                                           "span more than one weight version.",
    "strawq_batch_seq": "Sequence number of the last batch the trainer read.",
    "strawq_batch_groups": "Groups in the last batch the trainer read.",
    "strawq_batch_samples": "Samples in the last batch the trainer read.",
    "strawq_batch_tokens": "Tokens in the last batch the trainer read.",
    # a dataset of a mixture (label dataset)
    "strawq_dataset_weight": "The dataset's weight in the mixture.",
    "strawq_dataset_group_share": "The dataset's share of the groups trained in the last 8 "
                                  "batches.",
    "strawq_dataset_token_share": "The dataset's share of the tokens trained in the last 8 "
                                  "batches.",
    "strawq_dataset_group_share_overall": "The dataset's share of the groups trained over "
                                          "the run.",
    "strawq_dataset_token_share_overall": "The dataset's share of the tokens trained over "
                                          "the run.",
    "strawq_dataset_trained_groups_total": "Groups of the dataset trained over the run.",
    "strawq_dataset_trained_tokens_total": "Tokens of the dataset trained over the run.",
    "strawq_dataset_filtered_total": "Groups of the dataset its filter dropped.",
    "strawq_dataset_stale_total": "Groups of the dataset over its staleness bound.",
    "strawq_dataset_starved": "1 while the dataset falls short of its weight.",
    # a producer's own endpoint
    "strawq_producer_slots": "Group slots this producer generates at once.",
    "strawq_producer_busy_trajectories": "Samples this producer is generating now.",
    "strawq_producer_heartbeat_failing": "1 while this producer's heartbeats fail past its "
                                         "deadline (it claims nothing).",
    "strawq_producer_waiting_for_weights": "1 while every engine of this producer holds "
                                           "weights other than the run's.",
    "strawq_producer_engines_stale": "Engines of this producer out of rotation now.",
    "strawq_producer_dropped_groups_total": "Groups this producer dropped, by reason.",
    "strawq_producer_generation_tokens_total": "Tokens this producer generated (as SGLang's "
                                               "generation_tokens_total).",
}


@dataclass(frozen=True)
class Series:
    family: str
    kind: str  # "counter" or "gauge"
    labels: tuple[tuple[str, str], ...] = ()


def _base(name: str) -> str:
    base = _PROM_NAME.sub("_", name)
    if base.endswith("_per_s"):
        base = base[:-len("_per_s")] + "_per_second"
    elif base.endswith("_s"):
        base = base[:-len("_s")] + "_seconds"
    return base


def series(name: str) -> Series:
    """The Prometheus series of the metric ``name`` (see the module docstring)."""
    labels: tuple[tuple[str, str], ...] = ()
    head, _, rest = name.partition("/")
    if head in ("dropped", "producer_dropped") and rest and "/" not in rest:
        family = "strawq_dropped_groups_total" if head == "dropped" else \
            "strawq_producer_dropped_groups_total"
        return Series(family, "counter", (("reason", rest),))
    if head in _KEYED and rest.count("/") == 1:
        key, _, field = rest.partition("/")
        labels = ((_KEYED[head], key),)
        name = f"{head}/{field}"
    if name.endswith("_share_total"):
        return Series("strawq_" + _base(name[:-len("_total")] + "_overall"), "gauge", labels)
    base = "strawq_" + _base(name)
    if name in COUNTER_NAMES or base.endswith("_total"):
        return Series(base if base.endswith("_total") else base + "_total", "counter", labels)
    return Series(base, "gauge", labels)


def prom_name(name: str) -> str:
    """The Prometheus family of the metric ``name``."""
    return series(name).family


def help_text(family: str) -> str:
    known = HELP.get(family)
    if known is not None:
        return known
    words = family.removeprefix("strawq_").removesuffix("_total").replace("_", " ")
    return (f"strawq's {words} count." if family.endswith("_total") else
            f"strawq's {words} (docs/operations.md#metrics).")


def numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


Values = dict[Series, float]


def to_series(values: Mapping[str, Any]) -> Values:
    """The numeric values of a metrics line, by series (``time`` and text left out)."""
    return {series(k): float(v) for k, v in values.items() if k != "time" and numeric(v)}


class Exposition:
    """The values of one exporter, in its own registry, with constant ``labels``.

    ``update`` sets the values given; a plain series not given again keeps its last value
    (as a gauge would), while the keyed ones (a label from the name: producer, dataset,
    reason) are replaced as a whole by those of each update, so a producer the grantor
    forgot leaves no series behind. ``source`` (called at each scrape) adds values read
    then, and wins on a clash."""

    def __init__(self, labels: Mapping[str, str] | None = None,
                 source: Callable[[], Mapping[str, Any]] | None = None) -> None:
        from prometheus_client import CollectorRegistry

        self.labels = dict(labels or {})
        self.source = source
        self._values: Values = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self._server: Any = None
        self.port: int | None = None

    def update(self, values: Mapping[str, Any]) -> None:
        got = to_series(values)
        with self._lock:
            kept = {s: v for s, v in self._values.items() if not s.labels}
            self._values = {**kept, **got}

    def describe(self) -> list[Any]:
        return []  # collected at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            values = dict(self._values)
        if self.source is not None:
            values.update(to_series(self.source()))
        families: dict[str, Any] = {}
        const = list(self.labels)
        for s, v in sorted(values.items(), key=lambda kv: (kv[0].family, kv[0].labels)):
            fam = families.get(s.family)
            if fam is None:
                names = const + [k for k, _ in s.labels]
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                fam = families[s.family] = cls(s.family, help_text(s.family), labels=names)
            fam.add_metric([*self.labels.values(), *(v2 for _, v2 in s.labels)], v)
        yield from families.values()

    def text(self) -> str:
        """The exposition text, as a scrape would get it."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: any free port); returns the port."""
        from prometheus_client import start_http_server

        result = start_http_server(port, addr=addr, registry=self.registry)
        if isinstance(result, tuple):  # prometheus_client >= 0.20 returns (server, thread)
            self._server = result[0]
            self.port = int(self._server.server_port)
        else:
            self.port = port
        log.info("metrics: Prometheus endpoint on %s:%s", addr, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
