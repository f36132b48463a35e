"""A rolling upgrade across an on-disk format change: lost = duplicated = 0.

Runs ``strawq.testing.upgrade.rolling_upgrade``: two producers, the collector and a trainer
share one run while they are restarted one by one from the old release (run format 1) onto a
new one that knows a (simulated) format 2, ``strawq upgrade`` is refused while an old part
is live and goes through once none is, and the run drains on format 2. The anchor, measured
in the same run, is the same restarts without a format change; the ratio is the upgrade's
wall time over the anchor's.

    python bench/chaos_upgrade.py [--quick] [--tasks N]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strawq.testing.upgrade import UpgradeResult, rolling_upgrade  # noqa: E402


def measure(n: int, *, across_format: bool) -> tuple[UpgradeResult, float]:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        res = rolling_upgrade(d, n=n, across_format=across_format)
        return res, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="24 tasks (a few seconds)")
    ap.add_argument("--tasks", type=int, default=None, help="tasks in the run (default 96)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    n = args.tasks or (24 if args.quick else 96)
    measure(8, across_format=False)  # warm-up: imports and first-use caches
    anchor, t_anchor = measure(n, across_format=False)
    res, t = measure(n, across_format=True)
    print(f"anchor (same restarts, no format change): lost = {anchor.lost}, duplicated = "
          f"{anchor.duplicated}, {anchor.trained}/{anchor.released} trained, {t_anchor:.2f}s")
    for p in res.problems:
        print(f"  problem: {p}")
    ok = (res.lost == res.duplicated == 0 and not res.problems and res.old_refused
          and res.written.get(2, 0) > 0)
    print(f"chaos_upgrade: {res.line()}; wall time {t / t_anchor:.2f}x the anchor"
          + ("" if ok else " FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
