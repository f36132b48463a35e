"""Dataset mixtures (``strawq.data.mixture``): the interleave's exact shares, reading from any
row, the stopping strategies, the fingerprint that refuses a changed weight, and the feeder
naming each task's source."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from strawq.data.binding import DatasetMismatch
from strawq.data.dataset import BadRow
from strawq.data.feeder import Feeder
from strawq.data.mixture import (
    Layout,
    Mixture,
    MixtureSource,
    integer_weights,
    load_mixture,
    open_dataset,
    pattern_of,
)
from strawq.errors import ConfigError
from strawq.tasks.states import TaskState, names_in
from tests.collector.helpers import make_run


def _write(path: Path, name: str, n: int, bad: tuple[int, ...] = ()) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write("{broken\n" if i in bad else json.dumps({"prompt": f"{name}{i}"}) + "\n")
    return str(path)


def _spec(tmp: Path, sources: list[dict[str, Any]], **kw: Any) -> str:
    path = tmp / "m.mixture.json"
    path.write_text(json.dumps({"sources": sources, **kw}))
    return str(path)


def _mix(tmp: Path, sizes: dict[str, int], weights: dict[str, float], **kw: Any) -> Mixture:
    for name, n in sizes.items():
        _write(tmp / f"{name}.jsonl", name, n)
    m = open_dataset(_spec(tmp, [{"name": k, "path": f"{k}.jsonl", "weight": weights[k]}
                                 for k in sizes], **kw))
    assert isinstance(m, Mixture)
    return m


def _prompts(m: Mixture, start: int = 0) -> list[str]:
    return [r["prompt"] for _, r in m._iter_raw(start) if not isinstance(r, BadRow)]


@pytest.mark.parametrize("weights", [[1, 1], [3, 7], [0.2, 0.5, 0.3], [1, 2, 3, 5],
                                     [0.999, 0.001]])
def test_any_period_of_rows_holds_each_source_exactly_its_weight(weights: list[float]) -> None:
    ints = integer_weights(weights)
    total = sum(weights)
    for w, i in zip(weights, ints, strict=True):  # the ratio, to the resolution of 1/1000
        assert abs(i / sum(ints) - w / total) <= 1e-3
    lay = Layout(ints)
    pat = pattern_of(ints)
    assert [pat.count(k) for k in range(len(ints))] == ints
    seq = [lay.locate(i)[0] for i in range(5 * lay.period + 7)]
    for start in range(0, len(seq) - lay.period, 3):  # any window of one period, not only aligned
        window = seq[start:start + lay.period]
        assert [window.count(k) for k in range(len(ints))] == ints
    seen = [0] * len(ints)  # locate / count / position agree with counting from row 0
    for i, k in enumerate(seq):
        assert lay.locate(i) == (k, seen[k])
        assert [lay.count(i, j) for j in range(len(ints))] == seen
        assert lay.position(k, seen[k]) == i
        seen[k] += 1


def test_first_exhausted_ends_the_pass_with_the_first_source_and_reads_from_any_row(
        tmp_path: Path) -> None:
    m = _mix(tmp_path, {"a": 10, "b": 25}, {"a": 0.3, "b": 0.7})
    rows = _prompts(m)
    assert len(rows) == len(m) == 34  # a's 10 rows end it; b gave 24 of its 25
    assert [r for r in rows if r.startswith("a")] == [f"a{i}" for i in range(10)]
    assert [r for r in rows if r.startswith("b")] == [f"b{i}" for i in range(24)]
    for start in random.Random(0).sample(range(len(rows)), 12):  # a resume anywhere
        assert _prompts(m, start) == rows[start:]
    assert [m.source_of(i) for i in range(len(rows))] == [r[0] for r in rows]


def test_all_exhausted_oversamples_a_short_source_until_every_source_gave_every_row(
        tmp_path: Path) -> None:
    m = _mix(tmp_path, {"a": 4, "b": 9}, {"a": 1, "b": 1}, stopping_strategy="all_exhausted")
    rows = _prompts(m)
    assert len(rows) == len(m) == 18
    assert [r for r in rows if r.startswith("b")] == [f"b{i}" for i in range(9)]
    assert [r for r in rows if r.startswith("a")] == [f"a{i % 4}" for i in range(9)]
    assert _prompts(m, 11) == rows[11:]


def test_a_bad_row_of_a_source_is_a_bad_row_of_the_mixture_at_its_index(tmp_path: Path) -> None:
    _write(tmp_path / "a.jsonl", "a", 5, bad=(1,))
    _write(tmp_path / "b.jsonl", "b", 5)
    m = open_dataset(_spec(tmp_path, [{"name": "a", "path": "a.jsonl"},
                                      {"name": "b", "path": "b.jsonl"}]))
    got = list(m._iter_raw(0))
    bad = [(i, r) for i, r in got if isinstance(r, BadRow)]
    assert len(bad) == 1
    i, row = bad[0]
    assert m.source_of(i) == "a" and row.index == i and row.message.startswith("a: ")
    assert "line 2" in row.message


def test_the_feeder_names_each_tasks_source_and_refuses_a_changed_weight(
        tmp_path: Path) -> None:
    m = _mix(tmp_path, {"a": 10, "b": 25}, {"a": 0.3, "b": 0.7})
    q = make_run(str(tmp_path / "run"), release_batch=8)
    f = Feeder(q, m)
    while not f.exhausted:
        if not f.release(7):
            break
    assert len(names_in(q.storage, TaskState.PENDING)) == 34
    leases = q.claim("p", 100)
    assert sorted(int(x.task["index"]) for x in leases) == list(range(34))
    for lease in leases:
        assert lease.task["source"] == lease.task["row"]["prompt"][0]
    # the same files and weights elsewhere: the same dataset; another weight: refused
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("a", "b"):
        (moved / f"{name}.jsonl").write_bytes((tmp_path / f"{name}.jsonl").read_bytes())
    same = open_dataset(_spec(moved, [{"name": "a", "path": "a.jsonl", "weight": 3},
                                      {"name": "b", "path": "b.jsonl", "weight": 7}]))
    Feeder(q, same)
    other = open_dataset(_spec(moved, [{"name": "a", "path": "a.jsonl", "weight": 0.4},
                                       {"name": "b", "path": "b.jsonl", "weight": 0.6}]))
    with pytest.raises(DatasetMismatch, match="not the run's dataset"):
        Feeder(q, other)


@pytest.mark.parametrize("sources, match", [
    ([], "at least one source"),
    ([{"name": "a", "path": "a.jsonl"}, {"name": "a", "path": "b.jsonl"}], "repeated: \\['a'\\]"),
    ([{"name": "a", "path": "a.jsonl", "weight": 0}], "weight must be > 0"),
    ([{"name": "a", "path": "a.jsonl", "wieght": 1}], "unknown key"),
    ([{"name": "a b", "path": "a.jsonl"}], "invalid mixture source name"),
    ([{"name": "a", "path": "a.jsonl", "max_staleness": -1}], "max_staleness must be >= 0"),
    (["a.jsonl"], "expected an object"),
])
def test_a_bad_mixture_file_is_one_clear_error(tmp_path: Path, sources: list[Any],
                                               match: str) -> None:
    _write(tmp_path / "a.jsonl", "a", 3)
    _write(tmp_path / "b.jsonl", "b", 3)
    with pytest.raises(ConfigError, match=match):
        load_mixture(_spec(tmp_path, sources))


def test_a_mixture_source_that_does_not_exist_names_itself(tmp_path: Path) -> None:
    from strawq.errors import DatasetError

    with pytest.raises(DatasetError, match="does not exist"):
        Mixture([MixtureSource(name="a", path=str(tmp_path / "nope.jsonl"))])
