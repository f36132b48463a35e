"""The chaos benchmark's weight-version parts on their own (bench/chaos_versions.py): the
"invented" check flags a trained token no engine answered and a token trained under another
version than the engine stamped, and accepts a sample resumed over several answers; each
workload's collector runs its schedule's ``collector_config``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.config import load_config
from strawq.demo.schedule import ScheduleConfig, collector_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chaos_versions import BATCH_GROUPS, SPECS, collector_sets, invented, runs  # noqa: E402


def _group(task: str, gen: int, *samples: tuple[list[int], list[int]]) -> dict[str, Any]:
    return {"id": task, "gen": gen,
            "samples": [{"t": t, "v": runs(v)} for t, v in samples]}


def _answer(task: str, i: int, gen: int, ids: list[int], vers: list[int], t: float
            ) -> tuple[str, int, int, tuple[int, ...], tuple[int, ...], float]:
    return (task, i, gen, tuple(ids), tuple(vers), t)


def test_a_sample_resumed_over_answers_of_two_leases_is_not_invented() -> None:
    outputs = [_answer("t1", 0, 1, [5, 6, 9], [0, 0, 0], 1.0),     # a discarded answer
               _answer("t1", 0, 1, [5, 6, 7], [2, 2, 2], 2.0),     # aborted at the update
               _answer("t1", 1, 2, [4, 4, 4, 4], [3, 3, 3, 3], 3.0),
               _answer("t1", 0, 2, [8, 9], [3, 3], 4.0)]           # resumed by the next lease
    lineage = [_group("t1", 2, ([5, 6, 7, 8, 9], [2, 2, 2, 3, 3]), ([4, 4, 4, 4], [3] * 4))]
    assert invented(lineage, outputs) == ([], [], 2)


@pytest.mark.parametrize("tokens, versions, which", [
    ([5, 6, 7, 8, 1], [2, 2, 2, 3, 3], "invented"),   # a token no answer holds
    ([5, 6, 7, 8], [2, 2, 2, 3], "invented"),          # an answer cut short
    ([8, 9, 5, 6, 7], [3, 3, 2, 2, 2], "invented"),    # the answers in another order
    ([5, 6, 7, 8, 9], [3, 3, 3, 3, 3], "versions"),    # stamped with the version it resumed on
    ([5, 6, 9], [2, 2, 2], "versions"),                # the discarded answer, restamped
])
def test_a_trained_sample_no_engine_answered_is_counted(tokens: list[int],
                                                        versions: list[int],
                                                        which: str) -> None:
    outputs = [_answer("t1", 0, 1, [5, 6, 7], [2, 2, 2], 1.0),
               _answer("t1", 0, 2, [8, 9], [3, 3], 2.0),
               _answer("t1", 0, 1, [5, 6, 9], [0, 0, 0], 3.0)]
    bad, wrong, checked = invented([_group("t1", 2, (tokens, versions))], outputs)
    assert checked == 1
    assert (bad, wrong) == ((["t1.g2/0"], []) if which == "invented" else ([], ["t1.g2/0"]))


def test_answers_of_another_task_or_sample_do_not_count() -> None:
    outputs = [_answer("t2", 0, 1, [5, 6], [1, 1], 1.0),
               _answer("t1", 1, 1, [5, 6], [1, 1], 2.0)]
    assert invented([_group("t1", 1, ([5, 6], [1, 1]))], outputs)[0] == ["t1.g1/0"]


@pytest.mark.parametrize("workload", sorted(SPECS))
def test_each_workload_runs_its_schedules_collector_config(workload: str) -> None:
    spec = SPECS[workload]
    sets = collector_sets(workload, slots=8)
    assert sets[::2] == ["--set"] * (len(sets) // 2)
    got = load_config(CollectorConfig, None, sets[1::2])
    want = collector_config(ScheduleConfig(mode=spec.mode, batch_groups=BATCH_GROUPS,
                                           micro_batches=spec.micro, slots=8,
                                           max_staleness=spec.max_staleness))
    fields = ("batch_groups", "batches_per_version", "max_staleness", "admission_batches",
              "max_running", "max_ready", "max_prefetch_batches")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.eta_mode == spec.eta_mode
    assert got.batches_per_version == (2 if workload in ("stream", "flow") else 1)
