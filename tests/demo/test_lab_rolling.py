"""The lab's ``stream`` schedule with the rolling weight update, tiny, end to end: every
step trained once, nothing dropped or regenerated, every sample over η counted, no group
parked by a bracket, and the engines loaded the versions (a fleet pause > 0)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("matplotlib")

from strawq.demo.lab import LabConfig, run_mode  # noqa: E402
from tests.demo.test_lab import TINY  # noqa: E402

pytestmark = pytest.mark.slow


def test_lab_stream_with_the_rolling_update(tmp_path) -> None:
    cfg = LabConfig(workdir=str(tmp_path / "lab"), modes=("stream",),
                    **{**TINY, "weight_update": "rolling", "rolling_wave": 1})
    r = run_mode(cfg, "stream")
    assert r.problems == []
    flat = [i for step in r.trained for i in step]
    assert len(r.trained) == cfg.steps and len(flat) == len(set(flat))
    row = r.row
    assert row["weight_update"] == "rolling"
    # over η only what was counted (kept and trained, eta_mode train), as with the bracket:
    # the hard bound is not this mode's (an engine lagging by η adds no token older than
    # the bracket's partials do)
    over = sum(1 for s in r.staleness if s > cfg.max_staleness)
    assert over <= row["stale_trained"] * cfg.group_size
    assert row["requeued_stale"] == 0 and row["dropped_stale"] == 0
    # no bracket was opened; every version was published
    runs = list((tmp_path / "lab").rglob("run.meta"))
    assert len(runs) == 1
    run = runs[0].parent
    assert not os.listdir(run / "control")
    assert any(n.startswith("manifest-") for n in os.listdir(run / "weights"))
    assert row["fleet_pause_engine_s"] > 0  # engines were loaded, one at a time
    # every version's write was recorded (its manifest's write_s), one update a step; the
    # trainer's wait for an update includes that write (one clock)
    assert row["updates"] == cfg.steps
    assert 0 < row["weights_write_s"] <= row["update_wait_s"]


def test_lab_rolling_publishes_deltas_under_publish_dir(tmp_path) -> None:
    """``publish_dir`` and ``max_delta_chain`` reach the reader's bracket: each version is
    copied under ``<publish_dir>/<mode>``, a delta while the chain allows, and the
    producers build the deltas under the mode's ``weights-cache``."""
    from strawq.storage import PosixStorage
    from strawq.weights.publish import WeightStore

    cfg = LabConfig(workdir=str(tmp_path / "lab"), modes=("stream",),
                    **{**TINY, "weight_update": "rolling", "rolling_wave": 1,
                       "publish_dir": str(tmp_path / "published"), "max_delta_chain": 8})
    r = run_mode(cfg, "stream")
    assert r.problems == []
    run = tmp_path / "lab" / "stream" / "run"
    kept = WeightStore(PosixStorage(str(run), writer_id="t")).kept()
    assert kept and all(os.path.dirname(m.path) == str(tmp_path / "published" / "stream")
                        for m in kept)
    assert any(m.is_delta for m in kept)  # only weights.bin was copied for those
    assert any(n.startswith("strawq-weights-")
               for n in os.listdir(tmp_path / "lab" / "stream" / "weights-cache"))
