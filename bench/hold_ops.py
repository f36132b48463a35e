"""What one bracket weight update costs a real producer in storage calls, its groups parked
(the default) against held through the pause (``timing.hold_through_pause``).

A producer holding ``--slots`` groups of ``--g`` samples (24 x 16) generates on an
in-process sim engine with the in-flight journal on (4 s window); once every group has
tokens the trainer's pause is written, and the storage calls the producer makes are
counted at the ``Storage`` interface (``FaultyStorage``) from the pause to its ack, and
from the resume until every slot is generating again (the parked groups claimed back and
their prefixes loaded, or the held ones going on). Every call is counted, its polls
(``control/``, ``pending/``) included; the background over 2 s of generating before the
pause is printed beside.

    python bench/hold_ops.py              # 24 groups x G=16
    python bench/hold_ops.py --quick      # 4 groups x G=4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from strawq.producers.engines.launch import EngineOptions  # noqa: E402
from strawq.producers.engines.sim_backend import SimConfig  # noqa: E402
from strawq.producers.engines.testing import EngineThread  # noqa: E402
from strawq.producers.producer import Producer  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402
from strawq.testing.faults import FaultyStorage  # noqa: E402
from strawq.weights.control import Control  # noqa: E402
from tests.producers.helpers import make_run, run_producers, wait_for  # noqa: E402
from tests.producers.test_faults import cfg  # noqa: E402

OPS = ("publish", "append", "rename", "delete", "read", "list")
SIM = SimConfig(time_scale=0.01, len_median=20, len_sigma=0.8, len_cap=120, cap_prob=0.02)


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in OPS}


def one(url: str, root: Path, slots: int, g: int, hold: bool) -> dict[str, Any]:
    run = root / ("hold" if hold else "park")
    make_run(str(run), slots * 8, lease_timeout_s=30.0, heartbeat_interval_s=5.0,
             group_size=g)
    f = FaultyStorage(PosixStorage(str(run), writer_id="p1", fsync=False))
    control = Control(PosixStorage(str(run), writer_id="trainer", fsync=False))
    p = Producer(cfg(run, [url], budget={"slots": slots},
                     sampling={"max_new_tokens": 3000, "ignore_eos": True, "seed": 3},
                     timing={"control_poll_s": 0.1, "idle_poll_s": 0.1,
                             "abort_deadline_s": 5.0, "journal_every_s": 4.0,
                             "hold_through_pause": hold}, producer_id="p1"),
                 queue=RunQueue(f))
    out: dict[str, Any] = {}

    def calls() -> dict[str, int]:
        return {k: f.counts.get(k, 0) for k in OPS}

    def running() -> bool:
        return len(p.runner.groups) == slots and all(
            a.run is not None and a.run.oldest_version() is not None and not a.held
            and bool(a.sample_tasks) for a in p.runner.groups.values())

    async def body() -> None:
        await wait_for(running, 60, "every slot generating")
        c0 = calls()
        await asyncio.sleep(2.0)
        out["background_2s"] = _delta(c0, calls())
        c1 = calls()
        control.pause(1)
        await wait_for(lambda: "p1" in control.state().acks, 60, "the ack", poll=0.01)
        c2 = calls()
        out["pause"] = _delta(c1, c2)
        control.resume(1)
        await wait_for(running, 60, "every slot generating again", poll=0.01)
        out["resume"] = _delta(c2, calls())
        st = p.stats()
        out["held"], out["yielded"] = st.groups_held, st.groups_yielded

    asyncio.run(run_producers([p], body))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=24)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.slots, args.g = 4, 4
    got = {}
    with EngineThread(EngineOptions(kind="sim", max_running=1024, sim=SIM)) as eng, \
            tempfile.TemporaryDirectory() as tmp:
        for hold in (False, True):
            got[hold] = r = one(eng.url, Path(tmp), args.slots, args.g, hold)
            print(f"{'held' if hold else 'parked'}: pause->ack {r['pause']}, resume->running "
                  f"{r['resume']} ({r['yielded']} yielded, {r['held']} held; background "
                  f"{r['background_2s']} in 2 s)")
    total = {h: sum(r["pause"].values()) + sum(r["resume"].values()) for h, r in got.items()}
    print(f"hold_ops: storage calls per update per producer holding {args.slots} groups x "
          f"G={args.g} (polls included): held = {total[True]} (pause->ack "
          f"{sum(got[True]['pause'].values())}), parked = {total[False]} (pause->ack "
          f"{sum(got[False]['pause'].values())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
