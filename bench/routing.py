"""Prefix-cache hits by routing policy, measured by the real SGLang server's ``cached_tokens``.

    python bench/routing.py [--quick] [--groups N] [--group-size G] [--prompt-len L]
                            [--segment T]

Two real SGLang 0.5.23 servers (the CPU fixture: ``strawq/testing/real_sglang.py``, a real
model). For each policy of ``ClientConfig.routing_policy`` — ``round_robin`` (the anchor)
and ``cache_aware`` — both servers' caches are flushed, then N groups run as a producer runs
them: each group a distinct prompt of L tokens, its G samples sent at once, each sample in
two segments (the second resumes from prompt + the first segment's T tokens, as a sample
interrupted by a weight update does), every request with a producer's rid
(``<producer>/<task>.g<gen>/<sample>.<n>``). The ``cache_aware warm`` row adds the
producer's ``GenerationConfig.warm_prefix``: the group's prompt is prefilled once (a request of
``max_new_tokens`` 0) before its G samples go, so they find it cached instead of all
prefilling it side by side. With sglang-router installed, three more rows put the real
router in front of both servers with its own ``--policy round_robin`` and ``--policy
cache_aware``, the last with the warm-up too (the client then sends everything to the
router).

The hit rate is Σ ``cached_tokens`` ÷ Σ ``prompt_tokens`` over the requests whose prefix an
engine already holds (a group's siblings share the prompt; a resume shares prompt and first
segment), per kind and together; a group's first prefill (the warm-up, where there is one)
is counted apart (nothing can be cached for it). Last line::

    routing: prefix-cache hit rate on resumes and group siblings = H (warm_prefix; without
    it C, round_robin R)

``--quick`` (CI) uses one server, named by ``STRAWQ_SGLANG_URL`` or started here, reached
under two URLs (127.0.0.1 and localhost): the two "engines" share one cache, so both
policies hit alike — it runs the path, not the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strawq.producers.engine_client import warm_prefix  # noqa: E402
from strawq.producers.engine_transport import ClientConfig  # noqa: E402
from strawq.producers.sglang_client import SGLangClient  # noqa: E402

KINDS = ("siblings", "resumes")


async def one_policy(urls: list[str], policy: str, keys: tuple[str | None, str | None],
                     groups: int, g: int, plen: int, seg: int, seed: int,
                     router: str | None = None, warm: bool = False) -> dict[str, Any]:
    client = SGLangClient(urls if router is None else (), router_url=router,
                          config=ClientConfig(routing_policy=policy, api_key=keys[0],
                                              admin_api_key=keys[1], generate_timeout_s=600.0))
    await client.start()
    rng = random.Random(seed)
    tally = {k: [0, 0] for k in (*KINDS, "first")}
    per_engine: dict[str, int] = {}
    try:
        await client.flush_cache()
        t0 = time.monotonic()
        for gi in range(groups):
            if gi:  # progress on stderr: CPU servers take tens of seconds a group
                print(f"  {policy}{' warm' if warm else ''}{' (router)' if router else ''}: "
                      f"group {gi + 1}/{groups}, {time.monotonic() - t0:.0f}s",
                      file=sys.stderr, flush=True)
            prompt = [rng.randrange(100, 20000) for _ in range(plen)]
            tid = f"i{gi:012d}"
            params = {"max_new_tokens": seg, "temperature": 1.0, "ignore_eos": True}

            async def sample(i: int, ids: list[int], n: int, tid: str = tid,
                             params: dict[str, Any] = params) -> Any:
                return await client.generate(ids, {**params, "sampling_seed": seed + i},
                                             rid=f"bench/{tid}.g0/{i}.{n}")

            warmed = None
            if warm:  # the producer's GenerationConfig.warm_prefix: the prompt prefilled once
                warmed = await warm_prefix(client, prompt, rid=f"bench/{tid}.g0/warm.0")
            firsts = await asyncio.gather(*(sample(i, prompt, 1) for i in range(g)))
            resumes = await asyncio.gather(*(sample(i, prompt + list(r.output_ids), 2)
                                             for i, r in enumerate(firsts)))
            # the group's first prefill: the warm-up, else the sample that found the least
            first = -1 if warmed is not None else min(
                range(g), key=lambda i: firsts[i].cached_tokens or 0)
            if warmed is not None:
                tally["first"][0] += warmed.cached_tokens or 0
                tally["first"][1] += warmed.prompt_tokens or len(prompt)
            for i, r in enumerate(firsts):
                kind = "first" if i == first else "siblings"
                tally[kind][0] += r.cached_tokens or 0
                tally[kind][1] += r.prompt_tokens or len(prompt)
                per_engine[r.url] = per_engine.get(r.url, 0) + 1
            for r in resumes:
                tally["resumes"][0] += r.cached_tokens or 0
                tally["resumes"][1] += r.prompt_tokens or plen + seg
                per_engine[r.url] = per_engine.get(r.url, 0) + 1
    finally:
        await client.close()
    rate = {k: (c / t if t else 0.0) for k, (c, t) in tally.items()}
    hit = sum(tally[k][0] for k in KINDS)
    tot = sum(tally[k][1] for k in KINDS)
    rate["both"] = hit / tot if tot else 0.0
    return {"rate": rate, "engines": per_engine}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="CI size: one server under two URLs, 2 groups of 2, 64-token prompts")
    ap.add_argument("--groups", type=int, default=None, help="groups per policy (default 6)")
    ap.add_argument("--group-size", type=int, default=4, help="G (default 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 192)")
    ap.add_argument("--segment", type=int, default=8, help="tokens of the first segment")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    groups = args.groups or (2 if args.quick else 6)
    plen = args.prompt_len or (64 if args.quick else 192)
    if args.quick and args.group_size == ap.get_default("group_size"):
        args.group_size = 2
    if groups < 1 or args.group_size < 2 or plen < 8 or args.segment < 1:
        ap.error("--groups >= 1, --group-size >= 2, --prompt-len >= 8 and --segment >= 1")
    from strawq.testing.real_sglang import RealServer, start_real_server, start_router

    servers: list[RealServer] = []
    external = os.environ.get("STRAWQ_SGLANG_URL")
    t0 = time.monotonic()
    try:
        if external:
            keys = (os.environ.get("STRAWQ_SGLANG_API_KEY") or None,
                    os.environ.get("STRAWQ_SGLANG_ADMIN_KEY") or None)
            base = external.rstrip("/")
        else:
            try:
                servers.append(start_real_server())
                if not args.quick:
                    servers.append(start_real_server())
            except RuntimeError as exc:
                print(f"routing: needs the real SGLang CPU fixture (make test builds it): "
                      f"{exc}", file=sys.stderr)
                return 1
            keys = (servers[0].api_key, servers[0].admin_api_key)
            base = servers[0].url
        if args.quick or len(servers) < 2:
            urls = [base, base.replace("127.0.0.1", "localhost")]
            what = "one server under two URLs (one shared cache: the path, not the figure)"
        else:
            urls = [s.url for s in servers]
            what = "two servers"
        print(f"routing: {what}, started in {time.monotonic() - t0:.0f}s; {groups} groups of "
              f"G={args.group_size}, {plen}-token prompts, resumes after {args.segment} tokens")
        res = {}
        cases: list[tuple[str, str | None]] = [("round_robin", None), ("cache_aware", None),
                                               ("cache_aware warm", None)]
        if len(servers) >= 2 and importlib.util.find_spec("sglang_router") is not None:
            cases += [("router round_robin", "round_robin"),
                      ("router cache_aware", "cache_aware"),
                      ("router cache_aware warm", "cache_aware")]
        for name, router_policy in cases:
            warm = name.endswith(" warm")
            policy = name.removesuffix(" warm").split()[-1]
            router = None
            if router_policy is not None:  # sglang-router's own policy in front of both
                router = start_router([sys.executable, "-m", "sglang_router.launch_router"],
                                      urls, api_key=keys[0],
                                      extra_args=("--policy", router_policy))
            try:
                res[name] = asyncio.run(one_policy(
                    urls, policy, keys, groups, args.group_size, plen, args.segment,
                    args.seed, router=router.url if router else None, warm=warm))
            finally:
                if router is not None:
                    router.stop()
            r = res[name]["rate"]
            spread = ", ".join(f"{n}" for n in res[name]["engines"].values())
            print(f"{name:<24} siblings {r['siblings']:.3f}  resumes {r['resumes']:.3f}  "
                  f"both {r['both']:.3f}  (group's first prefill {r['first']:.3f}; requests "
                  f"per {'router' if router_policy else 'engine'} {spread})")
    finally:
        for s in servers:
            s.stop()
    print(f"routing: prefix-cache hit rate on resumes and group siblings = "
          f"{res['cache_aware warm']['rate']['both']:.3f} (warm_prefix; without it "
          f"{res['cache_aware']['rate']['both']:.3f}, round_robin "
          f"{res['round_robin']['rate']['both']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
