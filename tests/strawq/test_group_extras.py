"""Per-token extras in group records: round trip, docs/design.md invariant 4, and old records
unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strawq.errors import CorruptRecord
from strawq.ondisk import records
from strawq.ondisk.extras import ROUTED_EXPERTS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS, Extra
from strawq.ondisk.groups import TOKEN_COLUMNS, GroupData, decode_group, decode_group_columns
from strawq.ondisk.records import Kind

#: written by the code before extras existed (a GROUP record, three samples, no extras)
OLD = Path(__file__).parent / "fixtures" / "group_without_extras.rec"


def _cols() -> dict[str, object]:
    return dict(task_id="i000000000042", index=42, prompt_ids=[5, 6, 7], sample_lens=[3, 0, 2],
                tokens=[10, 11, 2, 12, 13], logprobs=[-0.5, -0.25, -0.125, -1.0, -2.0],
                versions=[3, 3, 4, 4, 4], loss_mask=[1, 1, 1, 0, 1], rewards=[1.0, None, 0.5],
                status=["completed", "aborted", "truncated"],
                meta={"producer": "p0", "version_hint": 3})


def _extras() -> dict[str, Extra]:
    # rows: prompt extra P + r per sample = 6 + 3 + 5; response extras 5 tokens
    routed = np.arange(14 * 2 * 2, dtype=np.int32).reshape(14, 2, 2)
    routed[5] = routed[8] = routed[13] = -1  # each sample's last position: not computed
    return {ROUTED_EXPERTS: Extra(routed),
            TOP_P_TOKEN_IDS: Extra(np.array([10, 1, 11, 2, 12, 13, 4, 5], np.int32),
                                   np.array([2, 2, 1, 1, 2], np.int32)),
            TEACHER_LOGPROBS: Extra(np.array([-1, -2, -3, -4, -5], np.float32))}


def test_an_old_record_decodes_as_before_and_a_new_one_without_extras_is_identical() -> None:
    data = OLD.read_bytes()
    g = decode_group(data)
    assert g.extras == {} and "extras" not in g.summary()
    assert g.tokens.tolist() == [10, 11, 2, 12, 13] and g.sample_lens == [3, 0, 2]
    cols = decode_group_columns(data)
    assert cols.extras == {} and cols.columns["versions"].tolist() == [3, 3, 4, 4, 4]
    # the new code writes the same record for a group without extras; its summary adds
    # each sample's trained-token count (loss_tokens: the batch's loss denominators)
    new = records.decode(b"".join(GroupData(**_cols()).encode()))  # type: ignore[arg-type]
    old = records.decode(data)
    summary = dict(new.meta["group"])
    assert summary.pop("loss_tokens") == [3, 0, 1]
    assert summary == old.meta["group"] and bytes(new.payload) == bytes(old.payload)
    assert {k: v for k, v in new.meta.items() if k != "group"} == \
        {k: v for k, v in old.meta.items() if k != "group"}


@pytest.mark.parametrize("fast", [True, False])
def test_extras_round_trip_with_their_shapes(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fast:  # the pyarrow path (a stream the fast path does not take)
        monkeypatch.setattr(records, "decode_tables_fast", lambda *a: None)
    g = GroupData(**_cols(), extras=_extras())  # type: ignore[arg-type]
    data = b"".join(g.encode(Kind.PARTIAL))
    s = records.decode(data).meta["group"]
    assert s["extras"] == {
        ROUTED_EXPERTS: {"dtype": "int32", "shape": [2, 2], "prompt": True, "ragged": False},
        TOP_P_TOKEN_IDS: {"dtype": "int32", "shape": [], "prompt": False, "ragged": True},
        TEACHER_LOGPROBS: {"dtype": "float32", "shape": [], "prompt": False, "ragged": False}}
    for got in (decode_group(data).extras, decode_group_columns(data).extras):
        for name, want in _extras().items():
            assert np.array_equal(got[name].values, want.values), name
            assert (got[name].counts is None) == (want.counts is None)
    back = decode_group(data)
    s2 = back.sample_extras(2)  # sample 2: 2 tokens
    assert s2[ROUTED_EXPERTS].rows == 5 and s2[TEACHER_LOGPROBS].values.tolist() == [-4, -5]
    assert s2[TOP_P_TOKEN_IDS].values.tolist() == [13, 4, 5]
    assert s2[TOP_P_TOKEN_IDS].offsets().tolist() == [0, 1, 3]
    assert back.sample_extras(1)[ROUTED_EXPERTS].rows == 3  # the prompt only
    assert back.sample_extras(1)[TOP_P_TOKEN_IDS].rows == 0


def test_misaligned_extras_are_refused_on_encode_and_decode() -> None:
    bad = _extras()
    bad[TEACHER_LOGPROBS] = Extra(np.zeros(4, np.float32))
    with pytest.raises(CorruptRecord, match="teacher_logprobs.*4 rows, expected 5"):
        GroupData(**_cols(), extras=bad)  # type: ignore[arg-type]
    bad = _extras()
    bad[ROUTED_EXPERTS] = Extra(np.zeros((13, 2, 2), np.int32))  # forgot a prompt row
    with pytest.raises(CorruptRecord, match="13 rows, expected 14"):
        GroupData(**_cols(), extras=bad)  # type: ignore[arg-type]
    # a record whose extra column is one row short (written by something else)
    g = GroupData(**_cols(), extras=_extras())  # type: ignore[arg-type]
    tables = {"prompt": {"ids": g.prompt_ids},
              "tokens": {c: getattr(g, c) for c in TOKEN_COLUMNS},
              f"x.{TEACHER_LOGPROBS}": {"v": np.zeros(4, np.float32)}}
    summary = g.summary()
    summary["extras"] = {TEACHER_LOGPROBS: summary["extras"][TEACHER_LOGPROBS]}
    data = b"".join(records.encode(Kind.GROUP, {"group": summary}, tables))
    with pytest.raises(CorruptRecord, match="teacher_logprobs.*4 values, expected 5 rows"):
        decode_group_columns(data)
    with pytest.raises(CorruptRecord, match="teacher_logprobs"):
        decode_group(data)
    # declared but absent
    summary["extras"] = {TOP_P_TOKEN_IDS: {"dtype": "int32", "shape": [], "prompt": False,
                                           "ragged": True}}
    data = b"".join(records.encode(Kind.GROUP, {"group": summary}, tables))
    with pytest.raises(CorruptRecord, match="declared but its column"):
        decode_group_columns(data)


def test_ragged_counts_must_match_their_values() -> None:
    bad = _extras()
    bad[TOP_P_TOKEN_IDS] = Extra(np.arange(3, dtype=np.int32), np.array([2, 2, 1, 1, 2],
                                                                        np.int32))
    with pytest.raises(CorruptRecord, match="counts sum to 8 but there are 3 values"):
        GroupData(**_cols(), extras=bad)  # type: ignore[arg-type]
