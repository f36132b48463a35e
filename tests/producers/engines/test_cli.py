"""The engine CLI: argparse wiring, init-tiny, and a tiny engine served as a real process."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from tests.producers.engine_helpers import run

from strawq.producers.engines.cli import add_engine_parser, main, options_from_args
from strawq.producers.engines.testing import start_engine_subprocess
from strawq.producers.engines.tiny_model import load_weights, recompute_logprobs
from strawq.producers.sample import Sample, SamplerParams
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.sample_step import step_sample

pytestmark = pytest.mark.timeout(90)


def test_parser_builds_options_and_rejects_bad_kind() -> None:
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(
        ["serve", "--kind", "sim", "--port", "0", "--time-scale", "0.1", "--len-cap", "99"]
    )
    opts = options_from_args(args)
    assert (
        opts.kind == "sim"
        and opts.sim.time_scale == 0.1
        and opts.sim.len_cap == 99
        and opts.max_running == 256
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kind", "vllm"])


@pytest.mark.process
def test_tiny_subprocess_from_init_tiny_dir(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    assert (
        main(["init-tiny", "--out", str(model_dir), "--seed", "5", "--context-length", "256"]) == 0
    )
    proc = start_engine_subprocess(
        "tiny", model_path=str(model_dir), weight_version="3", max_running_requests=2
    )
    try:

        async def go() -> Sample:
            async with SGLangClient([proc.url]) as c:
                info = await c.model_info(proc.url)
                assert info["context_length"] == 256 and info["weight_version"] == "3"
                s = Sample.new(
                    "p", [4, 5, 6], SamplerParams(max_new_tokens=20, seed=1, ignore_eos=True)
                )
                await step_sample(c, s)
                return s

        s = run(go())
    finally:
        proc.stop()
    assert s.versions.tolist() == [3] * 20
    lp = recompute_logprobs(load_weights(model_dir), s.prompt_ids, s.response_ids)
    np.testing.assert_allclose(s.logprobs, lp, atol=1e-4, rtol=0)
