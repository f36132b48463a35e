"""slime's own training loop on strawq, end to end on one CPU process
(``strawq.testing.slime_loop``): several rollouts, a checkpoint, a kill before the next
checkpoint, a restart through slime's load path, more rollouts. Every sample is trained
exactly once (by sample id) and each step's gradient equals the single-process reference on
that step's batch, which holds a failed reward, a tool-failed sample, a group of one and a
group skipped at read time (a corrupt record)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collector.integrations.conftest import SLIME_MISSING

pytest.importorskip("slime.utils.types", reason=SLIME_MISSING)
pytest.importorskip("megatron.core", reason="slime's loss code needs megatron-core")

from strawq.testing.slime_loop import run_slime_loop  # noqa: E402

# slime's loss is torch.compile'd: the first call in a process compiles with g++
pytestmark = [pytest.mark.slime, pytest.mark.process, pytest.mark.slow,
              pytest.mark.timeout(600)]


def test_strawq_generates_slime_trains_through_slimes_loop(tmp_path: Path) -> None:
    r = run_slime_loop("collector", str(tmp_path), rollouts=4, kill_after=1)
    assert r["restarts"] == 1 and r["start_rollout_ids"] == [0, 1]
    assert r["steps"] == 4 and r["grad_checks"] == 4
    assert r["trained_twice"] == 0
    assert r["missing"] == 0 and r["unexpected"] == 0
    assert r["index_collisions"] == 0  # a group of one takes no other sample's index
    assert r["max_rel_grad_err"] <= 1e-5


def test_slime_generates_through_its_own_rollout_and_loop(tmp_path: Path) -> None:
    """Mode 1: slime's own ``sglang_rollout`` (its engine calls answered by a stand-in
    generate function) hands out from ``StrawqDataSource``; the kill leaves rollout 1's
    groups leased, the restart's ``load(0)`` returns them and they are trained once."""
    r = run_slime_loop("data-source", str(tmp_path), rollouts=4, kill_after=1)
    assert r["restarts"] == 1 and r["start_rollout_ids"] == [0, 1]
    assert r["steps"] == 4
    assert r["trained_twice"] == 0
    assert r["missing"] == 0 and r["unexpected"] == 0
    assert r["index_collisions"] == 0
