"""The integration examples in ``deploy/examples`` stay true to the code: the slime job's
flags are slime's own and its dotted paths resolve; the Megatron loop trains on a real
collector batch (``--toy``: CPU, one process)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from tests.collector.helpers import (
    EXAMPLES,
    SimProducer,
    drive,
    load_example,
    make_run,
    write_dataset,
)

pytestmark = pytest.mark.slow

@pytest.mark.slime
def test_slime_job_flags_are_slimes_and_paths_resolve(tmp_path, capsys):
    pytest.importorskip("slime.utils.misc", reason="slime not installed (docs/slime.md)")
    from slime.utils.misc import load_function

    job = load_example("slime_job")
    # slime's argument parser imports SGLang; its source is read, not imported
    spec = importlib.util.find_spec("slime.utils.arguments")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text(encoding="utf-8")
    for mode, flags in job.MODES.items():
        for i, flag in enumerate(flags):
            if not flag.startswith("--"):
                continue
            assert f'"{flag}"' in source, f"{mode}: {flag} is not a slime flag"
            value = flags[i + 1] if i + 1 < len(flags) else ""
            if value.startswith("strawq."):
                assert callable(load_function(value))
            elif value.startswith("slime."):
                module = value.rpartition(".")[0]
                assert importlib.util.find_spec(module) is not None
    cfg = tmp_path / "strawq.yaml"
    assert job.main(["collector", "--run", str(tmp_path / "run"), "--config", str(cfg),
                     "--async-train", "--", "--rollout-batch-size", "8"]) == 0
    data = yaml.safe_load(cfg.read_text())
    assert data["strawq_run"] == str(tmp_path / "run") and data["strawq_ack_lag"] == 2
    out = capsys.readouterr().out
    assert "train_async.py --rollout-batch-size 8" in out and "--custom-config-path" in out


@pytest.mark.megatron
@pytest.mark.timeout(300)
def test_megatron_loop_trains_on_collector_batches(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    run = str(tmp_path / "run")
    q = make_run(run, group_size=4)
    col = Collector(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 16)),
                    CollectorConfig(batch_groups=2, max_running=8, max_ready=8,
                                    max_prefetch_batches=2, poll_interval_s=0, gc_interval_s=0))
    col.start(wait=False)
    prods = [SimProducer(q, "p0", seed=1), SimProducer(q, "p1", seed=2)]
    for _ in range(200):
        drive(col, prods, 1)
        if len(col.batches.batch_seqs()[0]) >= 2:
            break
    state = tmp_path / "state.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_PORT": "29631"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "megatron_trainer_loop.py"), run, "--toy", "--steps",
         "2", "--max-tokens-per-gpu", "40", "--checkpoint", str(state)],
        capture_output=True, text=True, timeout=240, env=env,
        cwd=str(Path(__file__).resolve().parents[3]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(state.read_text())["batch_seq"] == 2
    assert {1, 2} <= col.batches.batch_seqs()[1]  # both acked
    assert q.current_version() == 2  # a weight update after each step
    assert "step 1 batch 2" in proc.stderr
