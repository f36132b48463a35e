"""``bench/chaos.py --workload all``'s arithmetic: the aggregate line sums the workloads'
faults, lost and duplicated, weights tokens lost per fault by each workload's faults and
takes the median over every recovery of every workload; a workload that wrote no summary
is read from its last line."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import chaos  # noqa: E402


def test_the_aggregate_weights_tokens_by_faults_and_takes_the_median_of_all_recoveries(
) -> None:
    rows = [
        {"workload": "default", "faults": 10, "lost": 0, "duplicated": 0,
         "tokens_lost_per_fault": 100.0, "recoveries": [1.0, 2.0, 3.0]},
        {"workload": "agentic", "faults": 30, "lost": 1, "duplicated": 2,
         "tokens_lost_per_fault": 20.0, "recoveries": [10.0]},
    ]
    agg = chaos.aggregate(rows)
    # T = (10 * 100 + 30 * 20) / 40 = 40, not the plain mean 60; R = median(1, 2, 3, 10)
    assert agg == {"workloads": 2, "faults": 40, "lost": 1, "duplicated": 2,
                   "tokens_lost_per_fault": 40.0, "recovery_p50": 2.5}
    assert chaos.aggregate_line(agg) == (
        "chaos: workloads = 2, faults = 40, lost = 1, duplicated = 2, "
        "tokens lost per fault = 40, recovery p50 = 2.50 s")


def test_no_faults_and_no_recoveries_give_zero_and_nan_not_an_error() -> None:
    agg = chaos.aggregate([{"workload": "default", "faults": 0, "lost": 0, "duplicated": 0,
                            "tokens_lost_per_fault": 0.0, "recoveries": []}])
    assert chaos.aggregate_line(agg) == (
        "chaos: workloads = 1, faults = 0, lost = 0, duplicated = 0, "
        "tokens lost per fault = 0, recovery p50 = nan s")


def test_a_workload_without_a_summary_is_read_from_its_last_line() -> None:
    agentic = ("chaos agentic: faults = 36, lost = 0, duplicated = 0, tool effects applied "
               "twice = 0, persisted tool calls re-executed = 0, environment mismatches = 0, "
               "tokens lost per fault = 9, recovery p50 = 8.35 s")
    row = chaos.summary_from_line("agentic", agentic)
    assert row is not None
    assert (row["faults"], row["lost"], row["duplicated"], row["tokens_lost_per_fault"]) == (
        36, 0, 0, 9.0)
    assert row["recoveries"] == [8.35] * 36  # its p50 stands for each of its recoveries
    plain = chaos.summary_from_line(
        "default", "chaos: faults = 7, lost = 0, duplicated = 1, tokens lost per fault = 98, "
        "recovery p50 = nan s")
    assert plain is not None and plain["duplicated"] == 1 and plain["recoveries"] == []
    assert chaos.summary_from_line("x", "chaos: fleet seconds lost per failure = 2.5") is None


def test_each_workload_gets_its_own_workload_workdir_and_summary() -> None:
    argv = ["--quick", "--workload", "all", "--workdir=/w", "--seed", "3", "--summary", "s"]
    assert chaos._passthrough(argv) == ["--quick", "--seed", "3"]
    assert "all" not in chaos.WORKLOADS and {"default", "agentic"} <= set(chaos.WORKLOADS)
