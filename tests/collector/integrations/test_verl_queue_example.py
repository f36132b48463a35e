"""``deploy/examples/verl_fully_async.py`` stays true to the code: its switch names a hook that
resolves, its command is verl's entry point, and its CPU part runs (docs/verl.md)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from tests.collector.helpers import load_example

pytestmark = pytest.mark.slow  # imports verl


def test_the_launch_line_is_verls_entry_point_with_a_hook_that_resolves(capsys) -> None:
    ex = load_example("verl_fully_async")
    assert ex.main(["launch", "--queue-dir", "/q", "--", "trainer.save_freq=10"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(f"{ex.SWITCH} +async_training.strawq_queue_dir=/q trainer.save_freq=10")
    module, _, fn = ex.HOOK.rpartition(".")
    assert callable(getattr(importlib.import_module(module), fn))
    pytest.importorskip("verl")
    assert importlib.util.find_spec(ex.ENTRY[-1]) is not None


def test_the_cpu_part_hands_out_again_what_the_checkpoint_does_not_cover(tmp_path: Path) -> None:
    pytest.importorskip("verl")
    res = load_example("verl_fully_async").check(str(tmp_path))
    assert res["taken_before_crash"] == [f"sample_0_{i}" for i in range(6)]
    assert res["committed"] == 4
    assert res["handed_out_again"] == [f"sample_0_{i}" for i in range(4, 12)]
