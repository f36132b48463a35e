"""The local engines' ``/generate`` model without HTTP (``engines/wire.py``): a body checked
as SGLang checks it, the requests it makes (sub-rids and seeds), names still importable
from the server module."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from strawq.producers.engines import server
from strawq.producers.engines.sim_backend import seed_for_rid
from strawq.producers.engines.core import Req
from strawq.producers.engines.wire import BadRequest, make_reqs, parse_generate


def _reqs(body: dict[str, Any]) -> list[Req]:
    async def go() -> list[Req]:
        return make_reqs(parse_generate(body, vocab_size=100, context_length=64))
    return asyncio.run(go())


def test_a_batch_gets_sub_rids_and_rid_seeds_n_gets_random_rids_and_seed_offsets() -> None:
    batch = _reqs({"input_ids": [[1, 2], [3]], "rid": "r",
                   "sampling_params": {"max_new_tokens": 4}})
    assert [r.rid for r in batch] == ["r_0", "r_1"]
    assert [r.seed for r in batch] == [seed_for_rid("r_0"), seed_for_rid("r_1")]
    assert [r.input_ids for r in batch] == [[1, 2], [3]]
    n = _reqs({"input_ids": [1, 2], "rid": "r",
               "sampling_params": {"n": 3, "max_new_tokens": 4, "sampling_seed": 10}})
    assert len({r.rid for r in n}) == 3 and "r" not in {r.rid for r in n}
    assert [r.seed for r in n] == [10, 11, 12]
    one = _reqs({"input_ids": [1, 2], "rid": "r", "sampling_params": {"max_new_tokens": 4}})
    assert [(r.rid, r.seed) for r in one] == [("r", seed_for_rid("r"))]


@pytest.mark.parametrize(("body", "message"), [
    ({"text": "hi"}, "text is not supported"),
    ({"input_ids": [1], "text": "hi"}, "exactly one"),
    ({"input_ids": []}, "cannot be empty"),
    ({"input_ids": [100]}, r"integers in \[0, 100\)"),
    ({"input_ids": [1] * 64}, "longer than the model's context length"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 63}}, "maximum context length"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "list length must match"),
    ({"input_ids": [1], "rid": ["a"], "sampling_params": {"max_new_tokens": 4}},
     "a list of rids"),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field `bogus`"),
])
def test_a_bad_body_is_a_bad_request_naming_what_is_wrong(body: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_generate(body, vocab_size=100, context_length=64)


def test_the_model_names_stay_importable_from_the_server() -> None:
    assert server.BadRequest is BadRequest
    assert server.parse_sampling_params({"n": 2})[1] == 2
