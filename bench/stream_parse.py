"""What streaming a reply costs the producer: SGLang 0.5.23's cumulative chunks, parsed.

The in-flight journal holds what a producer received (``strawq.producers.journal_flush``), so
bounding a sequence's loss in the middle of a long generation needs the engine client to
stream (``engine.client.stream``). SGLang 0.5.23 streams **cumulative** chunks unless it is
started with ``--incremental-streaming-output`` (``strawq.producers.sglang_protocol.
StreamReader``): every chunk carries the whole reply so far, so a reply of ``L`` tokens read
in chunks of ``k`` parses about ``L² / 2k`` tokens instead of ``L``. This bench measures that
on the producer's own parser: the CPU time of ``StreamReader.feed`` over every chunk of a
reply (the JSON decode and the checks of each chunk, as the client runs them), against the
anchor, the same reply parsed once unstreamed (``parse_generate_body``), in the same run,
best of ``REPEATS``. The chunks are built as the real server sends them (``output_ids``,
``output_token_logprobs`` triples, ``completion_tokens``, a null ``finish_reason`` until
the last, ``weight_version``).

    python bench/stream_parse.py [--quick]

Last line::

    stream_parse: streamed/unstreamed CPU = A (L1 tokens, interval k) ... B (L2 tokens, interval k)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strawq.producers.sglang_protocol import StreamReader, parse_generate_body  # noqa: E402

REPEATS = 3
LENGTHS = (1536, 4096, 32768)
QUICK_LENGTHS = (1536, 4096)
INTERVALS = (256, 32)
#: above this many chunks a case is left out (minutes of parsing, the point already made)
MAX_CHUNKS = 200


def reply(ids: list[int], n: int, final: bool) -> dict[str, object]:
    """A ``/generate`` reply (or cumulative chunk) of the first ``n`` of ``ids``."""
    out = ids[:n]
    return {"text": "", "output_ids": out, "meta_info": {
        "id": "r0", "prompt_tokens": 64, "completion_tokens": n,
        "finish_reason": {"type": "length", "length": n} if final else None,
        "output_token_logprobs": [[-0.25, t, None] for t in out], "weight_version": "0"}}


def best(fn: object, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()  # type: ignore[operator]
        times.append(time.process_time() - t)
    return min(times)


def case(length: int, interval: int, rng: random.Random) -> tuple[float, float, int]:
    """(streamed s, unstreamed s, chunks) for one reply of ``length`` tokens."""
    ids = [rng.randrange(32000) for _ in range(length)]
    whole = json.dumps(reply(ids, length, True)).encode()
    ends = list(range(interval, length, interval)) + [length]
    lines = [b"data: " + json.dumps(reply(ids, n, n == length)).encode() for n in ends]

    def streamed() -> None:
        r = StreamReader(url="bench")
        for line in lines:
            r.feed(line)
        r.result()

    def unstreamed() -> None:
        parse_generate_body(json.loads(whole), url="bench")

    return best(streamed), best(unstreamed), len(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"replies of {', '.join(map(str, QUICK_LENGTHS))} tokens only")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    print(f"{'tokens':>7} {'interval':>8} {'chunks':>6} {'unstreamed ms':>13} "
          f"{'streamed ms':>11} {'ratio':>6}")
    parts = []
    for length in lengths:
        for k in INTERVALS:
            if -(-length // k) > MAX_CHUNKS:
                continue
            s, u, chunks = case(length, k, rng)
            ratio = s / u if u > 0 else float("inf")
            print(f"{length:>7} {k:>8} {chunks:>6} {u * 1e3:>13.1f} {s * 1e3:>11.1f} "
                  f"{ratio:>6.1f}", flush=True)
            if k == INTERVALS[0]:
                parts.append(f"{ratio:.1f} ({length} tokens, interval {k})")
    print("stream_parse: streamed/unstreamed CPU = " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
