"""End to end on the real SGLang 0.5.23 server: a producer (G = 2) across two weight
updates to a different weight directory (the model with one tensor perturbed) keeps every
generated token, stamps each token with the version that produced it, and the trainer's
reader delivers them; directly and through the real sglang-router.

Real tier (marker ``sglang_real``): skipped with the reason without the CPU fixture,
required in CI.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.testing.real_sglang import BracketResult, RealServer, bracket_scenario
from tests.sglang_fixtures import start_router

pytestmark = [pytest.mark.sglang_real, pytest.mark.timeout(420)]

N_GROUPS, G, MAX_NEW = 2, 2, 48


def run_bracket_scenario(server: RealServer, workdir: Path, *,
                         router_url: str | None = None) -> BracketResult:
    return bracket_scenario(server, workdir, groups=N_GROUPS, group_size=G, max_new=MAX_NEW,
                            brackets=2, router_url=router_url)


def _check(result: BracketResult, workdir: Path) -> None:
    groups = result.groups
    assert len(groups) == N_GROUPS
    assert result.lost_requests == 0, "a request did not come back with its tokens"
    assert result.kept == result.generated, (result.kept, result.generated)
    spanning = 0
    for grp in groups.values():
        assert grp.sample_lens == [MAX_NEW] * G
        for i in range(G):
            c = grp.sample(i)
            vers = c["versions"]
            assert len(c["tokens"]) == len(c["logprobs"]) == len(vers) == len(c["loss_mask"])
            assert np.all(np.diff(vers) >= 0) and set(vers.tolist()) <= {0, 1, 2}
            spanning += int(vers.min() != vers.max())
    assert spanning > 0, "no sample spanned a weight update"
    # the trainer's reader delivers exactly what was generated
    q = result.queue
    col = Collector(q, Dataset(os.path.join(workdir / "run", "dataset.jsonl")),
                    CollectorConfig(batch_groups=N_GROUPS, max_running=N_GROUPS,
                                    max_ready=N_GROUPS, poll_interval_s=0, gc_interval_s=0))
    col.start(wait=False)
    for _ in range(50):
        col.step()
        if col.batches.batch_seqs()[0]:
            break
    batch = BatchReader(q).next_batch(timeout=30)
    assert int(batch.response_lens.sum()) == result.kept
    want = sorted(int(g.sample(i)["versions"].min()) for g in groups.values()
                  for i in range(G))
    assert sorted(int(v) for v in batch.sample_min_version.tolist()) == want


def test_producer_across_two_weight_updates_keeps_every_token(
        sglang_real: RealServer, tmp_path: Path) -> None:
    result = run_bracket_scenario(sglang_real, tmp_path)
    _check(result, tmp_path)


def test_producer_through_the_real_router(
        sglang_real: RealServer, sglang_router_cmd: list[str], tmp_path: Path) -> None:
    router = start_router(sglang_router_cmd, [sglang_real.url], log=tmp_path / "router.log",
                          api_key=sglang_real.api_key)
    try:
        result = run_bracket_scenario(sglang_real, tmp_path, router_url=router.url)
    finally:
        router.stop()
    _check(result, tmp_path)
