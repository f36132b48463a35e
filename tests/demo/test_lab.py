"""``strawq lab`` at a tiny size, all three modes, end to end: invariants, not timings.

Real sim engine processes, producer processes, collector, bracket and reader; a few
seconds of work per mode. Checks: every released dataset index is trained once, dropped
with a reason, or still queued (the queue audit + the batches' indices); each step trained
B distinct groups; the report has every mode with finite numbers; async staleness <= eta.
"""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("matplotlib")

from strawq.demo.lab import MODES, LabConfig, format_table, run_lab  # noqa: E402

TINY = dict(engines=4, concurrency=8, sim_processes=2, producers=2, group_size=4,
            batch_groups=6, steps=3, train_step_s=0.4, max_staleness=1, oversample=1.5,
            step_base_ms=4.0, step_per_req_ms=0.1, prompt_len=8, len_median=8.0,
            len_sigma=0.5, len_cap=40, cap_prob=0.05, time_scale=1.0, fsync=False,
            progress=False)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def test_lab_tiny_all_modes(tmp_path) -> None:
    cfg = LabConfig(workdir=str(tmp_path / "lab"), **TINY)
    result = run_lab(cfg)

    assert list(result.modes) == list(MODES)
    for mode, r in result.modes.items():
        assert r.problems == [], f"{mode}: {r.problems}"
        assert r.row["steps"] == cfg.steps
        assert len(r.trained) == cfg.steps
        for step in r.trained:  # one sample_index per group, distinct within a step
            assert len(step) == cfg.batch_groups
        flat = [i for step in r.trained for i in step]
        assert len(flat) == len(set(flat)), f"{mode}: an index was trained twice"
        assert r.row["trained_samples"] == cfg.steps * cfg.batch_groups * cfg.group_size
        for key in ("trained_tokens_per_s", "trainer_wait_ratio", "engine_utilisation",
                    "rollout_to_train_end_s", "staleness_mean", "multi_version_share",
                    "generated_per_trained"):
            assert _finite(r.row[key]), f"{mode}: {key} = {r.row[key]!r}"
        assert 0.0 <= r.row["trainer_wait_ratio"] <= 1.0
        assert 0.0 <= r.row["engine_utilisation"] <= 1.0
        assert os.path.exists(r.files["timeline"])
        with open(r.files["row"], encoding="utf-8") as f:
            exported = json.load(f)
        assert exported["config"]["lab"]["batch_groups"] == cfg.batch_groups
        assert exported["config"]["collector"]["batch_groups"] == cfg.batch_groups

    assert result.modes["sync"].row["staleness_max"] == 0
    assert max(result.modes["async"].staleness) <= cfg.max_staleness
    assert max(result.modes["partial"].staleness) <= cfg.steps  # unbounded (APRIL)
    ratios = result.ratios()
    assert set(ratios) == set(MODES)
    assert all(_finite(v) for r in ratios.values() for v in r.values())
    with open(result.files["json"], encoding="utf-8") as f:
        saved = json.load(f)
    assert set(saved["rows"]) == set(MODES)
    assert LabConfig.from_dict(saved["config"]) == cfg  # the JSON reproduces the run
    table = format_table(result)
    for mode in MODES:
        assert mode in table
