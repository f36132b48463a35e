"""The loss lines of the docs, run on the shards that are empty: never NaN."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from strawq.collector.trainer.importance import batch_loss, masked_tis_weights
from strawq.collector.trainer.reader import BatchReader
from strawq.delivery.batches import BatchStore
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import SimProducer, make_run, write_dataset

DOCS = Path(__file__).resolve().parents[2] / "docs"
LOSS = re.compile(r"^\s*loss = (-(?:batch_loss)?\(w \* (\w+)\.advantages.*)$", re.M)


def _loss_lines() -> list[tuple[str, str, str]]:
    out = []
    for page in ("quickstart.md", "collector.md", "api.md"):
        for m in LOSS.finditer((DOCS / page).read_text()):
            out.append((page, m.group(1), m.group(2)))
    return out


def _three_group_batch(tmp_path: Path) -> RunQueue:
    from strawq.data.dataset import Dataset
    from strawq.data.feeder import Feeder

    q = make_run(str(tmp_path / "run"))
    Feeder(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 3))).release(3)
    p = SimProducer(q, "p", slots=3, max_new=(2, 4))
    for _ in range(10):
        p.step()
    bs = BatchStore(q)
    ready = bs.scan_ready()
    assert len(ready) == 3
    bs.publish_batch(1, ready, [bs.read_summary(n) for n in ready])
    return q


def test_every_loss_snippet_is_found() -> None:
    pages = {page for page, _line, _var in _loss_lines()}
    assert pages == {"quickstart.md", "collector.md", "api.md"}


@pytest.mark.parametrize("case", ["fewer_groups_than_ranks", "only_group_corrupt"])
def test_the_documented_loss_is_finite_on_an_empty_shard(tmp_path: Path, case: str) -> None:
    q = _three_group_batch(tmp_path)
    if case == "fewer_groups_than_ranks":
        batch = BatchReader(q, rank=3, world_size=4).next_batch(timeout=5)
    else:  # one rank per group; corrupt rank 0's group
        reader = BatchReader(q, rank=0, world_size=3)
        for n in BatchStore(q).read_manifest(1).groups:
            key = f"data/{n.id}~g{n.gen}.group"
            data = q.storage.read(key)
            q.storage.delete(key)
            q.storage.publish(key, data[: len(data) // 2])  # torn
        batch = reader.next_batch(timeout=5)
    assert batch.num_tokens == 0
    logp = torch.zeros(batch.num_tokens, requires_grad=True)
    w = masked_tis_weights(logp, batch.rollout_logprobs, batch.loss_mask, mode="tis")
    for page, line, var in _loss_lines():
        loss = eval(line, {"batch_loss": batch_loss}, {"w": w, "logp": logp, var: batch})  # noqa: S307
        assert torch.isfinite(loss), f"{page}: {line} is {loss} on an empty shard"


def test_the_documented_reward_contract_check_runs() -> None:
    page = (DOCS / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    (block,) = [b for b in blocks if "check_reward_fn(math_answer" in b]
    exec(block, {})  # noqa: S102 - our own docs; its assert checks the value
