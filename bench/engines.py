"""Benchmark of the local engines and the SGLang client.

    python bench/engines.py [--quick]

* tiny engine decode throughput (tokens/s) at 1, 8 and 32 concurrent requests;
* sim engine request throughput with 1,000 concurrent requests (time-scaled timing model);
* client overhead per request against a sim engine with zero step time.

Each engine runs as a separate process (``python -m strawq.producers.engines serve``), the client
in this process, as in production. The last line is ``engines: tiny tok/s @8 = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer tokens and requests (CI smoke run)"
    )
    args = parser.parse_args()
    max_new = 64 if args.quick else 256
    rounds = 1 if args.quick else 3
    rows: list[tuple[str, str]] = []

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

    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  result")
    print(f"{'-' * width}  {'-' * 24}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"engines: tiny tok/s @8 = {tiny_rates[8]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
