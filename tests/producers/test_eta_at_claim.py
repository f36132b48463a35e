"""A producer meets partial tasks past the η bound: a real sim engine over HTTP, a real
collector's published policy, memory and POSIX storage.

Groups are interrupted at version 0 (prefixes saved), the run moves to version 2 (η = 1: the
prefixes are 2 versions behind), and a second producer claims them under each ``eta_mode``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from strawq.ondisk.names import STAGE_PARTIAL, TaskName, data_key, note_key
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.group import sample_seed
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    SamplerParams,
    TimingConfig,
)
from strawq.producers.sglang_client import SGLangClient
from strawq.storage import MemoryStorage, PosixStorage
from strawq.tasks.eta import STALE_REASON
from strawq.tasks.queue import RunQueue
from tests.producers.helpers import ids, make_run, names, ready_groups, run_producers, wait_for

pytestmark = pytest.mark.timeout(120)

PLUGINS = "tests.producers.plugins_for_tests"
N = 4
ROWS = [{"prompt": [40 + i, 41, 42]} for i in range(N)]
SEED = 7
NEW_VERSION = 2  # η = 1: a prefix at version 0 is two versions behind
#: slow enough that a group of 4 × 400 tokens is still running when the producer stops
#: 2.5 ms a decode step: 400 tokens take 1 s, so the stop 50 ms in finds every group
#: mid-generation
SIM = SimConfig(time_scale=0.25, len_median=20, len_sigma=0.8, len_cap=120, cap_prob=0.02)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineThread]:
    with EngineThread(EngineOptions(kind="sim", max_running=256, sim=SIM)) as eng:
        yield eng


async def _push_version(url: str, version: int) -> None:
    async with SGLangClient([url]) as client:
        await client.update_weight_version(version, abort_all_requests=False)


def _config(run: Path, eng: Any, pid: str) -> ProducerConfig:
    return ProducerConfig(
        run_dir=str(run),
        engine=EngineConfig(workers=(eng.url,)),
        plugins=PluginsConfig(reward=f"{PLUGINS}.length_reward"),
        sampling=SamplerParams(max_new_tokens=400, ignore_eos=True, seed=SEED),
        budget=BudgetConfig(slots=N),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02),
        producer_id=pid)


def _interrupted_run(tmp_path: Path, kind: str, eng: Any) -> tuple[RunQueue, dict[str, TaskName]]:
    """A run whose groups were stopped mid-generation at version 0: its partial tasks."""
    storage = MemoryStorage(writer_id="setup") if kind == "memory" else \
        PosixStorage(str(tmp_path), writer_id="setup", fsync=False)
    q = make_run(str(tmp_path), 0, rows=ROWS, storage=storage)
    asyncio.run(_push_version(eng.url, 0))  # the engine holds the run's weights
    p1 = Producer(_config(tmp_path, eng, "p1"), queue=q)

    async def until_generating() -> None:
        await wait_for(lambda: p1.stats().busy_trajectories > 0, 30, "work started")
        await asyncio.sleep(0.05)  # a few tokens into 400 (the stop aborts and yields)

    asyncio.run(run_producers([p1], until_generating))
    partials = {t.id: t for t in names(q, "pending") if t.key.startswith(STAGE_PARTIAL)}
    assert partials and all(t.resume >= 0 and t.version == 0 for t in partials.values())
    return q, partials


def _finish(tmp_path: Path, q: RunQueue, eng: Any, mode: str) -> Producer:
    """The collector (η = 1, ``mode``) publishes its policy, the run moves to version 2,
    and a second producer settles every group."""
    col = Collector(q, Dataset(os.path.join(str(tmp_path), "dataset.jsonl")),
                    CollectorConfig(max_staleness=1, eta_mode=mode))  # type: ignore[arg-type]
    col.start(wait=False)
    q.set_version(NEW_VERSION)
    asyncio.run(_push_version(eng.url, NEW_VERSION))
    p2 = Producer(_config(tmp_path, eng, "p2"), queue=q)

    def settled() -> bool:
        return len(ids(q, "ready")) + len(ids(q, "dropped")) == N

    asyncio.run(run_producers([p2], lambda: wait_for(settled, 60, "every group settled")))
    col.close()
    return p2


def _ready(q: RunQueue) -> dict[str, TaskName]:
    return {t.id: t for t in names(q, "ready")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory", "posix"])
def test_regenerate_discards_a_stale_prefix_before_resuming_it(tmp_path: Path, engine: Any,
                                                               kind: str) -> None:
    q, partials = _interrupted_run(tmp_path, kind, engine)
    p2 = _finish(tmp_path, q, engine, "regenerate")
    st = p2.stats()
    assert st.partials_regenerated == len(partials) and st.partials_over_eta == 0
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(N)) and ids(q, "dropped") == []
    ready, groups = _ready(q), ready_groups(q)
    for tid, part in partials.items():
        name, g = ready[tid], groups[tid]
        # fresh: no prefix, every token generated on the new weights
        assert name.resume == -1 and np.all(g.versions == NEW_VERSION)
        assert g.sample_lens == [400] * 4
        # the discarded lease counted a regeneration, not an attempt (claimed twice after
        # the partial: the regenerated claim refunded)
        assert (name.gen, name.attempts) == (part.gen + 1, part.attempts + 1)
        assert name.regenerations == part.regenerations + 1
        # fresh seeds: drawn for the new generation, not the interrupted one's
        index = int(tid[1:])
        seeds = [p["seed"] for p in g.meta["params"]]
        assert seeds == [sample_seed(SEED, index, i, name.gen) for i in range(4)]
        assert seeds != [sample_seed(SEED, index, i, 0) for i in range(4)]
        # recorded with its reason; the superseded prefix is gone
        assert q.storage.exists(note_key(tid, part.gen, "fail", STALE_REASON))
        assert not q.storage.exists(data_key(tid, part.resume, "partial"))


@pytest.mark.parametrize("kind", ["memory", "posix"])
def test_drop_drops_a_stale_partial_with_its_reason(tmp_path: Path, engine: Any,
                                                    kind: str) -> None:
    q, partials = _interrupted_run(tmp_path, kind, engine)
    p2 = _finish(tmp_path, q, engine, "drop")
    assert ids(q, "dropped") == sorted(partials)
    assert {t.producer for t in names(q, "dropped")} == {STALE_REASON}
    for tid, part in partials.items():
        assert q.storage.exists(note_key(tid, part.gen, "drop", STALE_REASON))
    st = p2.stats()
    assert st.drop_reasons == {STALE_REASON: len(partials)}
    assert st.partials_over_eta == st.partials_regenerated == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory", "posix"])
@pytest.mark.parametrize("mode,counted", [("train", True), ("off", False)])
def test_train_and_off_resume_a_stale_prefix(tmp_path: Path, engine: Any, kind: str,
                                             mode: str, counted: bool) -> None:
    q, partials = _interrupted_run(tmp_path, kind, engine)
    p2 = _finish(tmp_path, q, engine, mode)
    st = p2.stats()
    assert st.partials_over_eta == (len(partials) if counted else 0)
    assert st.partials_regenerated == 0 and ids(q, "dropped") == []
    ready, groups = _ready(q), ready_groups(q)
    assert sorted(ready) == sorted(f"i{i:012d}" for i in range(N))
    for tid, part in partials.items():
        assert ready[tid].resume == part.resume  # the prefix was resumed
        assert groups[tid].versions.max() == NEW_VERSION
    assert any(groups[tid].versions.min() == 0 for tid in partials)  # old tokens kept
