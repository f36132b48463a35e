"""Benchmark of the local engines and the SGLang client.

    python bench/engines.py [--quick]

* tiny engine decode throughput (tokens/s) at 1, 8 and 32 concurrent requests;
* sim engine request throughput with 1,000 concurrent requests (time-scaled timing model);
* client overhead per request against a sim engine with zero step time;
* the real SGLang 0.5.23 server (the CPU fixture, when built; ``--real-url`` for a running
  one): the engine contract suite, and a producer (G = 2) across weight-update brackets to a
  perturbed weight directory and back: tokens kept across brackets / tokens generated (must
  be 1.000) and the bracket latency (pause written -> resume written), p50 and max.
  ``--quick`` (the CI size: fewer tokens and requests) leaves the real server out.

Each engine runs as a separate process (``python -m strawq.producers.engines serve``), the client
in this process, as in production. The last lines are ``engines: tiny tok/s @8 = X`` and
``engines: real sglang contract = P/N, tokens kept across brackets = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strawq.testing.real_sglang import (
    RealServer,
    bracket_scenario,
    default_fixture_home,
    default_tools_dir,
    fixture_problem,
    make_perturbed_copy,
    start_real_server,
)
from strawq.producers.engines.testing import start_engine_subprocess
from strawq.producers.sglang_client import ClientConfig, SGLangClient

PROMPT = list(range(10, 26))  # 16 tokens


async def tiny_tokens_per_s(url: str, concurrency: int, max_new: int, rounds: int) -> float:
    async with SGLangClient([url], config=ClientConfig(max_retries=0)) as c:
        await c.generate(PROMPT, {"max_new_tokens": 4})  # warm-up
        tokens = 0
        start = time.perf_counter()
        for r in range(rounds):
            results = await asyncio.gather(
                *(
                    c.generate(
                        PROMPT + [i],
                        {
                            "max_new_tokens": max_new,
                            "ignore_eos": True,
                            "sampling_seed": r * 1000 + i,
                        },
                    )
                    for i in range(concurrency)
                )
            )
            tokens += sum(len(x.output_ids) for x in results)
        return tokens / (time.perf_counter() - start)


async def sim_requests_per_s(url: str, n: int) -> tuple[float, float]:
    async with SGLangClient([url], config=ClientConfig(max_retries=0)) as c:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(
                c.generate(PROMPT + [i % 500], {"max_new_tokens": 512, "sampling_seed": i})
                for i in range(n)
            )
        )
        elapsed = time.perf_counter() - start
        tokens = sum(len(x.output_ids) for x in results)
        return n / elapsed, tokens / elapsed


async def client_overhead(url: str, n: int, concurrency: int) -> tuple[float, float]:
    async with SGLangClient([url], config=ClientConfig(max_retries=0)) as c:
        await c.generate(PROMPT, {"max_new_tokens": 1})
        start = time.perf_counter()
        for _ in range(n):
            await c.generate(PROMPT, {"max_new_tokens": 1})
        sequential_us = (time.perf_counter() - start) / n * 1e6
        start = time.perf_counter()
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await c.generate(PROMPT, {"max_new_tokens": 1})

        await asyncio.gather(*(one() for _ in range(n)))
        return sequential_us, n / (time.perf_counter() - start)


def real_contract(server: RealServer) -> tuple[int, int, int, list[str]]:
    """Run the engine contract suite's tests on the real server: passed, run, skipped."""
    import pytest

    from strawq.testing.engine_contract import EngineContract, EngineTarget

    target = EngineTarget(
        url=server.url, eos_token_id=2, vocab_size=49152, prompt=(504, 3575, 282, 4649, 314),
        weight_dirs=(server.model_dir, server.perturbed_dir), max_running=16, long_tokens=400,
        api_key=server.api_key, admin_api_key=server.admin_api_key, timeout_s=240.0,
    )
    suite = EngineContract()
    passed = run = skipped = 0
    failures: list[str] = []
    for name in sorted(n for n in dir(EngineContract) if n.startswith("test_")):
        try:
            getattr(suite, name)(target)
        except pytest.skip.Exception:
            skipped += 1
            continue
        except Exception as exc:  # noqa: BLE001 - a failing contract test is a result
            run += 1
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        run += 1
        passed += 1
    return passed, run, skipped, failures


def real_rows(url: str | None, rows: list[tuple[str, str]]) -> str:
    """The real-server measurements (rows) and the summary line, or why they were skipped."""
    if url:
        server = RealServer(url=url.rstrip("/"), model_dir="", perturbed_dir="")
        with urllib.request.urlopen(server.url + "/model_info", timeout=30) as resp:
            model = Path(json.loads(resp.read())["model_path"])
        server.model_dir = str(model)
        server.perturbed_dir = str(make_perturbed_copy(model, model.with_name(
            model.name + "-perturbed")))
    else:
        problem = fixture_problem(default_fixture_home(), default_tools_dir())
        if problem:
            return f"engines: real sglang skipped ({problem})"
        server = start_real_server()
        rows.append(("real sglang 0.5.23 (CPU fixture): server start", f"{server.started_s:.0f} s"))
    try:
        passed, run, skipped, failures = real_contract(server)
        rows.append(("real sglang: engine contract suite",
                     f"{passed}/{run} passed, {skipped} skipped"))
        for f in failures:
            rows.append(("  failed", f))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                res = bracket_scenario(server, Path(tmp), groups=2, group_size=2, max_new=32,
                                       brackets=3, timeout_s=900.0)
            except (TimeoutError, RuntimeError, OSError) as exc:
                rows.append(("real sglang: bracket scenario", f"failed: {exc}"))
                return (f"engines: real sglang contract = {passed}/{run}, "
                        f"tokens kept across brackets = n/a ({exc})")
        lat = sorted(res.latencies_s)
        p50 = lat[len(lat) // 2]
        rows.append(("real sglang: producer G=2, 2 groups x 32 tokens, 3 brackets: kept / gen",
                     f"{res.kept}/{res.generated} = {res.kept_ratio:.3f} "
                     f"({res.lost_requests} requests lost)"))
        rows.append(("real sglang: bracket latency (pause -> resume)",
                     f"p50 {p50:.2f} s, max {lat[-1]:.2f} s"))
        return (f"engines: real sglang contract = {passed}/{run}, "
                f"tokens kept across brackets = {res.kept_ratio:.3f}")
    finally:
        server.stop()


def _print(rows: list[tuple[str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  result")
    print(f"{'-' * width}  {'-' * 24}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer tokens and requests (CI smoke run)"
    )
    parser.add_argument("--real-url", default=None,
                        help="a running real SGLang server (no keys) instead of starting one")
    parser.add_argument("--no-real", action="store_true", help="skip the real-server part")
    parser.add_argument("--real-only", action="store_true", help="only the real-server part")
    args = parser.parse_args()
    max_new = 64 if args.quick else 256
    rounds = 1 if args.quick else 3
    rows: list[tuple[str, str]] = []

    if args.real_only:
        rows.append(("local engines", "skipped (--real-only)"))
        line = real_rows(args.real_url, rows)
        _print(rows)
        print(line)
        return 0

    tiny = start_engine_subprocess("tiny", max_running_requests=32)
    try:
        tiny_rates = {}
        for conc in (1, 8, 32):
            rate = asyncio.run(tiny_tokens_per_s(tiny.url, conc, max_new, rounds))
            tiny_rates[conc] = rate
            rows.append(
                (
                    f"tiny decode, {conc:>2} concurrent ({max_new} new tokens each)",
                    f"{rate:,.0f} tok/s",
                )
            )
    finally:
        tiny.stop()

    n_sim = 1000
    sim = start_engine_subprocess(
        "sim",
        max_running_requests=1000,
        step_base_ms=10,
        step_per_req_ms=0.05,
        time_scale=0.02,
        len_median=60 if args.quick else 150,
        len_sigma=1.0,
        len_cap=512,
        cap_prob=0.02,
    )
    try:
        req_s, tok_s = asyncio.run(sim_requests_per_s(sim.url, n_sim))
        rows.append(
            (
                f"sim, {n_sim} concurrent (step 10ms+0.05ms/req, time_scale 0.02)",
                f"{req_s:,.0f} req/s ({tok_s:,.0f} tok/s)",
            )
        )
    finally:
        sim.stop()

    zero = start_engine_subprocess(
        "sim", max_running_requests=256, step_base_ms=0, step_per_req_ms=0, prefill_ms_per_token=0
    )
    try:
        n = 300 if args.quick else 2000
        seq_us, conc_rps = asyncio.run(client_overhead(zero.url, n, 64))
        rows.append(
            (
                "client+server round trip, sequential, 1 token (sim, zero step)",
                f"{seq_us:,.0f} us/request",
            )
        )
        rows.append(
            ("client+server, 64 concurrent, 1 token (sim, zero step)", f"{conc_rps:,.0f} req/s")
        )
    finally:
        zero.stop()

    real_line = "engines: real sglang skipped (--no-real)"
    if args.quick:
        # the real server takes minutes to start and measure; the real tier's tests cover it
        real_line = "engines: real sglang skipped (--quick; run without it for the real server)"
    elif not args.no_real:
        real_line = real_rows(args.real_url, rows)

    _print(rows)
    print(f"engines: tiny tok/s @8 = {tiny_rates[8]:.0f}")
    print(real_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
