"""What a rolling weight update costs published full and as a delta against its base: bytes
the trainer writes to the shared directory per update, the trainer's wait per update, and
a producer's time to have the version ready to load (verify; a delta: build it on the
local disk and check it).

The model is a safetensors checkpoint of ``--layers`` shards of ``--layer-mb`` MB each (one
shard per layer, as a trainer that writes its checkpoint shard by shard lays it out), plus
a config. Each update the trainer writes the whole checkpoint to its local disk (the same
in both modes) and changes the tensors of a fraction ``--changed`` of the layers (the
others are frozen, or did not move: the bytes are the same). The full mode
(``max_delta_chain=0``) copies every shard into the publish directory; the delta mode
(``max_delta_chain=3``) copies the changed shards, and every fourth update is full. Both
run in the same process on the same disks; the figures are ratios delta / full.

    python bench/weights_delta.py            # 32 layers x 4 MB, 25% change, 8 updates
    python bench/weights_delta.py --quick    # 8 layers x 1 MB, 4 updates
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from safetensors.numpy import save_file  # noqa: E402

from strawq.collector.trainer.bracket import WeightUpdateBracket  # noqa: E402
from strawq.weights.publish import WeightStore  # noqa: E402
from tests.producers.helpers import make_run  # noqa: E402


class Checkpoints:
    """The trainer's side: layer tensors, a fraction of which move each update."""

    def __init__(self, root: Path, layers: int, layer_mb: float, changed: float,
                 seed: int) -> None:
        self.root = root
        self.rng = np.random.default_rng(seed)
        n = max(1, int(layer_mb * (1 << 20) / 4 / 2))
        self.layers = [{"w1": self.rng.standard_normal(n, dtype=np.float32),
                        "w2": self.rng.standard_normal(n, dtype=np.float32)}
                       for _ in range(layers)]
        self.moving = max(1, round(changed * layers))

    def write(self, version: int) -> str:
        if version > 1:
            for i in self.rng.choice(len(self.layers), self.moving, replace=False):
                for t in self.layers[i].values():
                    t += np.float32(1e-3)
        d = self.root / f"step{version}"
        d.mkdir(parents=True)
        for i, tensors in enumerate(self.layers):
            save_file({f"layers.{i}.{k}": v for k, v in tensors.items()},
                      str(d / f"model-{i:05d}.safetensors"))
        (d / "config.json").write_text(json.dumps({"layers": len(self.layers)}))
        return str(d)


def one(tmp: Path, args: argparse.Namespace, chain: int) -> dict[str, Any]:
    tag = f"chain{chain}"
    q = make_run(str(tmp / tag / "run"), 0, rows=[], group_size=2)
    bracket = WeightUpdateBracket(q, weight_update="rolling", wave=1, max_lag=1,
                                  publish_dir=str(tmp / tag / "published"),
                                  max_delta_chain=chain)
    store = WeightStore(q.storage)
    ckpt = Checkpoints(tmp / tag / "trainer", args.layers, args.layer_mb, args.changed,
                       args.seed)
    written, waits, publish, ready, deltas = [], [], [], [], 0
    spent = [0.0]

    def write(v: int) -> str:
        t = time.perf_counter()
        path = ckpt.write(v)
        spent[0] = time.perf_counter() - t
        return path

    size = 0
    for _ in range(args.updates):
        t0 = time.perf_counter()
        rep = bracket.publish_weights(write)
        m = rep.published
        assert m is not None
        waits.append(time.perf_counter() - t0)
        publish.append(waits[-1] - spent[0])
        written.append(m.written)
        size = m.bytes
        deltas += m.is_delta
        t0 = time.perf_counter()
        store.verify(m)
        store.materialize(m, tmp / tag / "node")
        ready.append(time.perf_counter() - t0)
    # the first update is full in both modes: the steady state is the rest
    return {"written": statistics.mean(written[1:]), "wait": statistics.mean(waits[1:]),
            "publish": statistics.mean(publish[1:]),
            "ready": statistics.mean(ready[1:]), "deltas": deltas,
            "bytes": size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--layer-mb", type=float, default=4.0)
    p.add_argument("--changed", type=float, default=0.25)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.layer_mb, args.updates = 8, 1.0, 4
    if args.updates < 2:
        p.error("--updates must be >= 2 (the first is full in both modes)")
    with tempfile.TemporaryDirectory() as tmp:
        full = one(Path(tmp), args, 0)
        delta = one(Path(tmp), args, 3)
    mb = 1 / (1 << 20)
    for name, r in (("full", full), ("delta", delta)):
        print(f"{name:>5}: {r['written'] * mb:7.1f} MB written per update, trainer wait "
              f"{r['wait']:.3f} s (publishing after the local write "
              f"{r['publish']:.3f} s), producer ready {r['ready']:.3f} s "
              f"({r['deltas']} of {args.updates} updates deltas)")
    print(f"weights_delta: delta/full per update ({args.layers} layers x "
          f"{args.layer_mb:g} MB, {args.changed:.0%} of the layers change) bytes written = "
          f"{delta['written'] / full['written']:.2f}, trainer wait = "
          f"{delta['wait'] / full['wait']:.2f} (its publishing part = "
          f"{delta['publish'] / full['publish']:.2f}), producer ready = "
          f"{delta['ready'] / full['ready']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
