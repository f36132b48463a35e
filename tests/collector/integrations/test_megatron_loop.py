"""The shipped Megatron example loop end to end on one CPU process
(``strawq.testing.megatron_loop``): steps, a kill inside a step, a restart from its
checkpoint, more steps; every sample trained once, each step's gradient the reference's on
a batch with a failed reward, a tool-failed sample, a group of one and a corrupt group, and
the restarted job's model the checkpointed one."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed")

from strawq.testing.megatron_loop import run_megatron_loop  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_megatron_example_loop_survives_a_kill_exactly_once(tmp_path: Path) -> None:
    r = run_megatron_loop(str(tmp_path), steps=4, kill_at=2)
    assert r["restarts"] == 1 and r["steps"] == 4
    assert r["grad_checks"] == 5  # the killed step was checked too
    assert r["trained_twice"] == 0 and r["missing"] == 0
    assert r["max_rel_grad_err"] <= 1e-5
    assert r["model_restored"]  # the example saves and restores the model with the reader
