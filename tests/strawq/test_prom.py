"""``strawq.views.prom``: metric names to Prometheus series by its conventions."""

from __future__ import annotations

import pytest

from strawq.views.prom import Exposition, Series, series

parser = pytest.importorskip("prometheus_client.parser")


@pytest.mark.parametrize("name,expected", [
    ("queue/ready", Series("strawq_queue_ready", "gauge")),
    ("trainer/wait_s", Series("strawq_trainer_wait_seconds", "gauge")),
    ("collector/groups_per_s", Series("strawq_collector_groups_per_second", "gauge")),
    ("trainer/step", Series("strawq_trainer_step_total", "counter")),
    ("collector/released_total", Series("strawq_collector_released_total", "counter")),
    ("dropped/stale_eta", Series("strawq_dropped_groups_total", "counter",
                                 (("reason", "stale_eta"),))),
    ("dataset/math/trained_groups_total",
     Series("strawq_dataset_trained_groups_total", "counter", (("dataset", "math"),))),
    ("dataset/math/group_share_total",
     Series("strawq_dataset_group_share_overall", "gauge", (("dataset", "math"),))),
    ("dataset/pass", Series("strawq_dataset_pass", "gauge")),
    ("producer/p-1.a/heartbeat_age_s",
     Series("strawq_producer_heartbeat_age_seconds", "gauge", (("producer", "p-1.a"),))),
    ("producer_dropped/reward_error", Series("strawq_producer_dropped_groups_total", "counter",
                                             (("reason", "reward_error"),))),
])
def test_names_map_to_series(name: str, expected: Series) -> None:
    assert series(name) == expected


def test_a_forgotten_producer_leaves_no_series_and_plain_gauges_keep_their_value() -> None:
    exp = Exposition({"run": "r"})
    exp.update({"producer/a/up": 1, "producer/b/up": 1, "trainer/wait_ratio": 0.5,
                "note": "text", "time": 1.0})
    exp.update({"producer/a/up": 1})
    fams = {f.name: f for f in parser.text_string_to_metric_families(exp.text())}
    assert [s.labels for s in fams["strawq_producer_up"].samples] == [
        {"run": "r", "producer": "a"}]
    assert fams["strawq_trainer_wait_ratio"].samples[0].value == 0.5
    assert "strawq_time" not in fams and "strawq_note" not in fams
    assert fams["strawq_trainer_wait_ratio"].documentation.endswith(".")


def test_a_source_is_read_at_each_scrape() -> None:
    n = {"v": 1}
    exp = Exposition({"run": "r"}, source=lambda: {"producer/slots": n["v"]})
    assert "strawq_producer_slots{run=\"r\"} 1.0" in exp.text()
    n["v"] = 3
    assert "strawq_producer_slots{run=\"r\"} 3.0" in exp.text()
