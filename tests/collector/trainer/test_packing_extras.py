"""ShardPacker packs per-token extras like log-probs: prompts, placeholders, ragged ids."""

from __future__ import annotations

import numpy as np

from strawq.collector.trainer.packing import ShardPacker, offsets_name
from strawq.ondisk.extras import ROUTED_EXPERTS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS, Extra
from strawq.ondisk.groups import GroupData, decode_group_columns

TOP_P_OFFSETS = offsets_name(TOP_P_TOKEN_IDS)


def group(task: str, prompt: list[int], lens: list[int], *, extras: bool) -> GroupData:
    n = sum(lens)
    p, g = len(prompt), len(lens)
    x: dict[str, Extra] = {}
    if extras:
        rows = p * g + n
        x[ROUTED_EXPERTS] = Extra(np.arange(rows, dtype=np.int32).reshape(rows, 1) + 500)
        x[TOP_P_TOKEN_IDS] = Extra(np.arange(2 * n, dtype=np.int32) + 900,
                                   np.full(n, 2, np.int32))
        x[TEACHER_LOGPROBS] = Extra(-np.arange(1, n + 1, dtype=np.float32))
    return GroupData(task_id=task, index=0, prompt_ids=np.array(prompt), sample_lens=lens,
                     tokens=np.arange(n) + 10, logprobs=np.zeros(n), versions=np.zeros(n),
                     loss_mask=np.ones(n), rewards=[1.0] * g, status=["completed"] * g,
                     extras=x)


def pack(groups: list[GroupData], skip: int | None = None) -> ShardPacker:
    pk = ShardPacker([g.summary() for g in groups])
    for k, g in enumerate(groups):
        if k == skip:
            continue
        cols = decode_group_columns(b"".join(g.encode()))
        pk.check(k, cols.prompt, cols.summary["sample_lens"], g.task_id)
        pk.check_extras(cols.extras, g.task_id)
        pk.add(k, cols.prompt, cols.columns)
        pk.add_extras(k, cols.extras)
    pk.finish()
    return pk


def test_extras_over_prompts_and_responses_and_placeholders_for_a_group_without() -> None:
    a = group("a", [1, 2], [2, 1], extras=True)  # packed: [1 2 r r][1 2 r] = 7 tokens
    b = group("b", [3], [2], extras=False)  # packed: [3 r r] = 3 tokens
    pk = pack([a, b])
    routed = pk.extras[ROUTED_EXPERTS]
    assert routed.shape == (10, 1)
    assert routed[:7, 0].tolist() == list(range(500, 507))  # the record's rows, prompts too
    assert (routed[7:] == -1).all()  # group b recorded none: not computed
    teacher = pk.extras[TEACHER_LOGPROBS]
    assert teacher.tolist() == [0, 0, -1, -2, 0, 0, -3, 0, 0, 0]
    off = pk.extras[TOP_P_OFFSETS]
    assert off.tolist() == [0, 0, 0, 2, 4, 4, 4, 6, 6, 6, 6]
    assert pk.extras[TOP_P_TOKEN_IDS].tolist() == list(range(900, 906))


def test_a_group_left_out_is_compacted_away_with_its_extras() -> None:
    a = group("a", [1, 2], [2, 1], extras=True)
    c = group("c", [4, 5], [1], extras=True)
    pk = pack([a, c], skip=0)  # group a failed its checks
    assert pk.tokens.tolist() == [4, 5, 10]
    assert pk.extras[ROUTED_EXPERTS][:, 0].tolist() == [500, 501, 502]
    assert pk.extras[TOP_P_OFFSETS].tolist() == [0, 0, 0, 2]
    assert pk.extras[TOP_P_TOKEN_IDS].tolist() == [900, 901]
