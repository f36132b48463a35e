"""``strawq bracket status|finish|abort RUN``: the weight-update bracket, settled by what the
engines hold.

``status`` reads ``control/`` and asks every known engine (registered by producers in
``engine-urls/``, noted in ``engines/``, or named with ``--engine``) for its weight version,
then says what ``finish`` would do; it writes nothing. ``finish`` announces the version the
engines hold (``WeightUpdateBracket.finish_weight_update``); ``abort`` resumes producers on
the run's version and refuses while an engine already holds the bracket's (``--force``
aborts anyway). An engine that does not answer within ``--timeout`` is reported, never
waited for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from strawq.argtypes import positive_float
from strawq.errors import StrawqError
from strawq.weights.engine_weights import (
    PROBE_TIMEOUT_S,
    EngineProbe,
    EngineWeights,
    probe_versions,
)

#: the actions, in the order ``strawq bracket --help`` lists them
ACTIONS: tuple[tuple[str, str], ...] = (
    ("status", "is a bracket open, who acked it, and which weight version each engine holds"),
    ("finish", "announce the version the engines hold and resume producers on it"),
    ("abort", "resume producers without a new weight version (refused while an engine "
              "already holds the bracket's)"),
)

DESCRIPTION = ("The weight-update bracket pauses every producer while the trainer loads new "
               "weights. 'status' shows it and what each engine holds; 'finish' settles a "
               "bracket whose trainer died by what the engines hold (their version is "
               "announced, or the update undone when they still hold the old one); 'abort' "
               "releases it without a new version and refuses when the new weights already "
               "reached an engine.")

Emit = Callable[..., None]


def add_bracket_arguments(p: argparse.ArgumentParser, action: str) -> None:
    """The options of one action (besides RUN, --json and -q/-v)."""
    p.add_argument("--engine", action="append", default=[], metavar="URL",
                   help="an engine to ask besides those the producers registered "
                   "(repeatable)")
    p.add_argument("--timeout", type=positive_float, default=PROBE_TIMEOUT_S, metavar="SECONDS",
                   help=f"how long to wait for each engine's answer (default "
                   f"{PROBE_TIMEOUT_S:g}); all are asked at once")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the engines' --api-key, if they were started with one")
    if action == "abort":
        p.add_argument("--force", action="store_true",
                       help="abort even though an engine holds the bracket's version (put "
                       "the old weights back on it first, or producers keep it out)")


def _engines_payload(found: dict[str, EngineProbe]) -> dict[str, dict[str, Any]]:
    return {u: {"version": p.version, "error": p.error} for u, p in sorted(found.items())}


def _engine_lines(found: dict[str, EngineProbe]) -> list[str]:
    if not found:
        return ["  engines: none known (producers register theirs in engine-urls/; name "
                "others with --engine URL)"]
    width = max(len(u) for u in found)
    return ["  engines:"] + [f"    {u:<{width}}  {p.describe()}" for u, p in sorted(found.items())]


def run_bracket(args: argparse.Namespace, open_queue: Callable[..., Any], emit: Emit) -> int:
    """``strawq bracket ACTION``; ``open_queue`` and ``emit`` are the CLI's own."""
    from strawq.collector.trainer.bracket import WeightUpdateBracket, settle
    from strawq.weights.control import read_state

    action = args.bracket_command
    q = open_queue(args.path, read_only=action == "status")
    timeout = float(args.timeout)
    st = read_state(q.storage)
    current = q.current_version()
    extra = [u.rstrip("/") for u in args.engine]
    found = probe_versions(set(EngineWeights(q.storage).known()) | set(extra),
                           timeout_s=timeout, api_key=args.api_key)
    plan = settle(st, current, found)
    payload: dict[str, Any] = {"open": st.paused, "pause_version": st.pause_version,
                               "resume_version": st.resume_version,
                               "acked": sorted(st.acks), "current_version": current,
                               "engines": _engines_payload(found),
                               "settle": {"action": plan.action, "version": plan.version,
                                          "message": plan.message}}
    if action == "status":
        head = (f"weight-update bracket for version {st.pause_version} is OPEN: producers are "
                f"paused (acked: {', '.join(sorted(st.acks)) or 'none'}); weight version "
                f"{current}" if st.paused else
                f"no weight-update bracket is open (weight version {current})")
        lines = [head, *_engine_lines(found)]
        if plan.action in ("finish", "undo"):
            lines.append(f"{plan.message}; run 'strawq bracket finish {args.path}'")
        elif plan.action == "refuse":
            lines.append(plan.message)
        emit(args, payload, "\n".join(lines), report=True)
        return 0
    bracket = WeightUpdateBracket(q, rank=0, engine_urls=extra, probe_timeout_s=timeout,
                                  api_key=args.api_key, repair_interval_s=None)
    if action == "finish":
        if plan.action == "none":
            raise StrawqError(f"nothing to finish at {args.path}: {plan.message}")
        done = bracket.finish_weight_update(engines=found)
        payload.update(open=False, finished=done.action, version=done.version)
        what = (f"finished the weight update: version {done.version} announced, producers "
                f"resume on it" if done.action == "finish" else
                f"undid the weight update to version {done.bracket}: the engines hold "
                f"version {done.version}, producers resume on it")
        emit(args, payload, "" if args.quiet else what)
        return 0
    if not st.paused:
        raise StrawqError(f"no weight-update bracket is open at {args.path} (last pause "
                          f"{st.pause_version}, last resume {st.resume_version}); nothing "
                          "to abort")
    bracket.abort_weight_update(force=args.force, engines=found)
    payload.update(open=False, aborted=st.pause_version)
    emit(args, payload, "" if args.quiet else
         f"aborted the weight update to version {st.pause_version}: producers resume on "
         f"weight version {current}")
    return 0
