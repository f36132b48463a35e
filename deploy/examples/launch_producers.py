"""Start one producer actor per eligible Ray node for a run, and keep them reconciled.

Run it on the Ray head (or any node of the cluster) once the run exists (``strawq init``)
and the engines and router are up:

    python deploy/examples/launch_producers.py deploy/examples/run.json

It connects to the Ray cluster given by ``--address`` (else ``RAY_ADDRESS``, else the one
Ray cluster running on this host: with several, it refuses and lists them rather than pick
one), builds the
``ProducerConfig`` and ``PlacementConfig`` sections of the run config, starts a producer on
every alive node with CPU (K = floor(C*E/G) group slots split over them), follows nodes
joining and leaving, prints the producers' stats every ``--stats-every`` seconds, and on
SIGINT/SIGTERM stops them cleanly: each parks its groups as partial tasks first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_config import load  # noqa: E402

log = logging.getLogger("launch_producers")


def choose_address(given: str | None, env: str | None, found: Sequence[str]) -> str:
    """The Ray address to connect to: ``--address``, else ``RAY_ADDRESS``, else the one
    cluster ``found`` on this host. Several found (a second Ray instance on the host), or
    none, is a ``ConfigError`` that lists them and says how to choose: never a guess."""
    from strawq.errors import ConfigError

    if given:
        return given
    if env:
        return env
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError("no Ray cluster runs on this host: start one ('ray start --head'), "
                          "or pass --address HOST:PORT of a remote one; without Ray, start "
                          "the producers with 'strawq producer' or the whole run with "
                          "'strawq cluster up RUN.json'")
    raise ConfigError(f"{len(found)} Ray clusters run on this host ({', '.join(sorted(found))})"
                      "; pass --address with the one the run's engines belong to (or set "
                      "RAY_ADDRESS): connecting to whichever started last could place the "
                      "producers on the wrong cluster")


def _local_ray_clusters() -> list[str]:
    try:  # Ray's own discovery of this host's clusters (not a public API: best effort)
        from ray._private.services import find_gcs_addresses

        return sorted(find_gcs_addresses())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - without it, Ray's "auto" decides
        return ["auto"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run config JSON (see deploy/examples/run.json)")
    p.add_argument("--address", default=None, help="Ray cluster address HOST:PORT (default: "
                   "RAY_ADDRESS, else the one Ray cluster on this host)")
    p.add_argument("--stats-every", type=float, default=60.0, help="seconds between stats lines")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import ray

    from strawq.errors import ConfigError
    from strawq.producers.placement import ProducerPlacement

    try:
        cfg = load(args.config)
        address = choose_address(args.address, os.environ.get("RAY_ADDRESS"),
                                 [] if args.address else _local_ray_clusters())
    except ConfigError as exc:
        print(f"launch_producers: error: {exc}", file=sys.stderr)
        return 1
    ray.init(address=address)
    placement = ProducerPlacement(cfg.producer, cfg.placement, group_size=cfg.group_size)
    rep = placement.reconcile()  # ConfigError with the numbers when C*E < W*G
    log.info("started %d producers; budget K=%d, slots %s", len(rep.started),
             rep.budget.total if rep.budget else 0, rep.slots)
    placement.start_background()

    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    while not stop.wait(args.stats_every):
        if placement.last_error is not None:
            log.error("last reconcile failed: %s", placement.last_error)
        for node, st in placement.stats().items():
            log.info("node %s: %s", node[:12], json.dumps(
                {k: st.get(k) for k in ("producer_id", "slots", "groups_completed",
                                        "groups_dropped", "groups_yielded", "leases_lost",
                                        "slot_utilisation", "paused")}))
    log.info("stopping producers (they park their groups as partial tasks)")
    placement.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
