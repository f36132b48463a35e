"""Golden SGLang 0.5.x response shapes the client must parse, and malformed ones it must reject."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.producers.engine_helpers import FIXTURES, load_fixture

from strawq.producers.engine_errors import EngineProtocolError
from strawq.producers.sglang_client import parse_workers
from strawq.producers.sglang_protocol import (
    parse_generate_body,
    parse_generate_response,
    parse_version,
)

pytestmark = pytest.mark.timeout(30)

BAD = sorted(p.name for p in (FIXTURES / "bad").glob("*.json"))


def test_completed_stop_token() -> None:
    r = parse_generate_response(load_fixture("good/completed_stop_token.json"), url="http://w")
    assert r.finish_type == "stop" and r.finish_reason["matched"] == 2
    assert r.output_ids.tolist() == [7042, 30, 2]
    assert (
        r.output_ids.dtype == np.int32
        and r.logprobs.dtype == np.float32
        and r.versions.dtype == np.int64
    )
    np.testing.assert_allclose(r.logprobs, [-0.27, -0.39, -0.01], rtol=1e-6)
    assert r.versions.tolist() == [7, 7, 7] and r.weight_version == 7
    assert r.prompt_tokens == 5 and r.cached_tokens == 4 and not r.is_abort


def test_aborted_running_keeps_partial_tokens() -> None:
    r = parse_generate_response(load_fixture("good/aborted_running.json"))
    assert r.is_abort and not r.is_waiting_abort
    assert len(r.output_ids) == len(r.logprobs) == len(r.versions) == 40


def test_aborted_waiting_queue_shape_without_prompt_tokens() -> None:
    r = parse_generate_response(load_fixture("good/aborted_waiting.json"))
    assert r.is_abort and r.is_waiting_abort
    assert r.prompt_tokens is None and len(r.output_ids) == 0 and len(r.versions) == 0


def test_weight_version_spans_give_per_token_versions() -> None:
    r = parse_generate_response(load_fixture("good/length_two_versions.json"))
    assert r.versions[:31].tolist() == [5] * 31 and r.versions[31:].tolist() == [6] * 89
    assert r.weight_version == 6 and r.num_retractions == 1 and r.finish_type == "length"


def test_missing_spans_fall_back_to_single_version() -> None:
    r = parse_generate_response(load_fixture("good/stop_string_no_spans_0_5_15.json"))
    assert r.versions.tolist() == [4, 4] and r.finish_reason["matched"] == "."


def test_n_greater_than_one_list() -> None:
    rs = parse_generate_body(load_fixture("good/n2_list.json"))
    assert [r.rid for r in rs] == ["grp_0", "grp_1"]
    assert [r.output_ids.tolist() for r in rs] == [[11], [12]]


def test_segment_conversion_matches_arrays() -> None:
    r = parse_generate_response(load_fixture("good/aborted_running.json"))
    seg = r.to_segment()
    assert seg.token_ids is r.output_ids and dict(seg.finish_reason)["type"] == "abort"


@pytest.mark.parametrize("name", BAD)
def test_malformed_responses_are_rejected(name: str) -> None:
    with pytest.raises(EngineProtocolError) as info:
        parse_generate_body(load_fixture(f"bad/{name}"), url="http://worker-7:30000")
    assert "http://worker-7:30000" in str(info.value)


def test_non_numeric_version_message_says_what_to_do() -> None:
    with pytest.raises(EngineProtocolError, match="--weight-version 0"):
        parse_version("default")
    assert parse_version("default", default_version=0) == 0
    assert parse_version("12") == 12
    r = parse_generate_response(load_fixture("bad/version_non_numeric.json"), default_version=0)
    assert r.versions.tolist() == [0, 0, 0]


def test_nan_logprob_rejected() -> None:
    body = json.loads((FIXTURES / "good/completed_stop_token.json").read_text())
    body["meta_info"]["output_token_logprobs"][0][0] = float("nan")
    with pytest.raises(EngineProtocolError, match="finite"):
        parse_generate_response(body)


def test_router_workers_shape() -> None:
    body = {
        "workers": [
            {
                "id": "2f1c",
                "url": "http://10.0.0.1:30000/",
                "is_healthy": True,
                "load": -1,
                "worker_type": "regular",
            },
            {"id": "9a0b", "url": "http://10.0.0.2:30000", "is_healthy": False, "load": 3},
        ],
        "total": 2,
    }
    workers = parse_workers(body)
    assert [w.url for w in workers] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert [w.is_healthy for w in workers] == [True, False] and workers[1].load == 3
    with pytest.raises(EngineProtocolError):
        parse_workers({"urls": ["http://x"]})
    with pytest.raises(EngineProtocolError):
        parse_workers({"workers": [{"id": "no-url"}]})
