"""Settling a weight-update bracket by what the engines hold.

A bracket a trainer left open (it died inside it), or one closed by an abort although its
version reached the engines, is settled by probing every known engine for its weight version
(``strawq.weights.engine_weights.probe_versions``): ``settle`` decides, purely, whether to announce
the bracket's version (every engine that answered holds it), resume without a new version
(every one still holds the run's), do nothing, or refuse (they disagree, or none answered),
with a message that names which engine holds what. ``WeightUpdateBracket.settlement`` and
``finish_weight_update`` apply it; ``strawq bracket status|finish`` print it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from strawq.weights.control import ControlState
from strawq.errors import BracketError
from strawq.weights.engine_weights import EngineProbe
from strawq.weights.fingerprint import may_clear

if TYPE_CHECKING:
    from strawq.tasks.queue import RunQueue
    from strawq.weights.control import Control
    from strawq.weights.engine_weights import EngineWeights


class _Bracket(Protocol):
    """What settling needs of a ``WeightUpdateBracket``."""

    queue: RunQueue
    control: Control
    engines: EngineWeights
    _open: int | None

    def _open_version(self) -> int: ...

    def engine_versions(self, timeout_s: float | None = None) -> dict[str, EngineProbe]: ...

    def end_weight_update(self, version: int | None = None) -> int: ...

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settlement:
    """How a bracket is settled by what the engines hold (``settle``)."""

    #: "finish": announce ``version`` (producers resume on it); "undo": resume without a
    #: new version (an abort); "none": nothing to settle; "refuse": cannot tell safely
    action: Literal["finish", "undo", "none", "refuse"]
    #: the version producers resume on (finish, undo, none); the run's version (refuse)
    version: int
    #: the bracket's version: open, or closed by an abort without being announced (None:
    #: neither)
    bracket: int | None
    #: True while the bracket is open (``pause-<v>`` without ``resume-<v>``)
    open: bool
    engines: dict[str, EngineProbe]
    message: str


def describe_engines(engines: Mapping[str, EngineProbe]) -> str:
    return ", ".join(f"{u} {p.describe()}" for u, p in sorted(engines.items())) or "none"


def settle(state: ControlState, current: int, engines: Mapping[str, EngineProbe]
           ) -> Settlement:
    """Decide, from ``control/``, the run's version and each engine's probe, how to settle
    the weight-update bracket: an open one, or one closed by an abort although its version
    reached the engines. Pure: nothing is read or written."""
    engines = dict(engines)
    held = {u: p.version for u, p in engines.items() if p.version is not None}
    down = {u: p for u, p in engines.items() if p.version is None}
    if state.paused:
        b: int | None = state.pause_version
    elif state.resume_version > current:
        b = state.resume_version  # resumed without its version: an abort
    else:
        b = None
    where = (f"the weight update to version {b} is open" if state.paused else
             f"the weight update to version {b} was aborted" if b is not None else
             f"no weight update is open (the run is at version {current})")
    found = f"engines: {describe_engines(engines)}"
    unheard = (f"; not heard from: {', '.join(sorted(down))} (producers keep an engine on "
               "other weights out of rotation once it answers)") if down and held else ""

    def out(action: Literal["finish", "undo", "none", "refuse"], version: int,
            message: str) -> Settlement:
        return Settlement(action, version, b, state.paused, engines, message)

    if not held:
        if b is None:
            return out("none", current, f"{where}; {found}")
        asked = found if engines else ("none known: producers register the engines they "
                                       "use in engine-urls/")
        return out("refuse", current,
                   f"{where} and no engine answered ({asked}), so nothing tells whether "
                   f"version {b} reached them: name them (--engine URL, or "
                   f"WeightUpdateBracket(engine_urls=...)) and try again, or abort if you "
                   f"know every engine still holds version {current}")
    versions = sorted(set(held.values()))
    if len(versions) > 1:
        by = "; ".join(f"version {v}: {', '.join(sorted(u for u in held if held[u] == v))}"
                       for v in versions)
        if b is None:
            return out("refuse", current,
                       f"{where} and the engines disagree ({by}{unheard}): producers keep "
                       f"those off version {current} out of rotation until the trainer's "
                       f"repair (WeightUpdateBracket(repair=...)) pushes it to them")
        return out("refuse", current,
                   f"{where} and the engines disagree ({by}{unheard}): bring them to one "
                   f"version first (retry the trainer's update: begin_weight_update "
                   f"continues the bracket and pushes to every engine; or put version "
                   f"{current}'s weights back on the others), then settle it again")
    e = versions[0]
    if b is None:
        if e == current:
            return out("none", current, f"{where}; every engine that answered holds it "
                       f"({found})")
        return out("refuse", current,
                   f"{where} but every engine that answered holds version {e} ({found}): "
                   f"producers keep them out of rotation; the trainer's repair "
                   f"(WeightUpdateBracket(repair=...)) pushes version {current} to them")
    if e >= b:
        return out("finish", e, f"{where}; every engine that answered holds version {e} "
                   f"(its weights reached them): finishing announces it and producers "
                   f"{'resume' if state.paused else 'go on'} on it{unheard}")
    if e == current and state.paused:
        return out("undo", current, f"{where}; every engine that answered still holds the "
                   f"run's version {current}, so the push did not reach them: resume without "
                   f"a new version (an abort){unheard}")
    if e == current:
        return out("none", current, f"{where}; every engine that answered holds the run's "
                   f"version {current} ({found})")
    return out("refuse", current,
               f"{where} but every engine that answered holds version {e}, neither the "
               f"bracket's {b} nor the run's {current} ({found}): push version {current} "
               f"or {b} to them first")


def abort_checked(b: _Bracket, *, force: bool,
                  engines: Mapping[str, EngineProbe] | None) -> None:
    """``WeightUpdateBracket.abort_weight_update``: resume producers on the old version,
    refused while an engine holds the bracket's version (unless ``force``)."""
    opened = b._open_version()
    if not force:
        found = b.engine_versions() if engines is None else engines
        ahead = {u: p for u, p in found.items()
                 if p.version is not None and p.version >= opened}
        if ahead:
            raise BracketError(
                f"abort of the weight update to version {opened} refused: the new "
                f"weights reached the engines ({describe_engines(ahead)}), and producers "
                f"resumed on version {b.queue.current_version()} would keep them out "
                f"of rotation. Finish the update instead (finish_weight_update(), or "
                f"'strawq bracket finish RUN'), or abort with force=True (--force) once "
                f"the old weights are back on them")
    b.control.resume(opened)
    b._open = None
    log.warning("weight update to version %d aborted; producers resume on version %d",
                opened, b.queue.current_version())


def finish(b: _Bracket, *, if_unknown: Literal["refuse", "end"],
           engines: Mapping[str, EngineProbe] | None) -> Settlement:
    """``WeightUpdateBracket.finish_weight_update``: settle an open bracket by the version
    the engines hold (``settle``)."""
    found = dict(b.engine_versions() if engines is None else engines)
    plan = settle(b.control.state(), b.queue.current_version(), found)
    held = any(p.version is not None for p in found.values())
    if plan.action == "refuse" and plan.open and not held and if_unknown == "end":
        log.warning("%s; announcing it as the caller asked (if_unknown='end')",
                    plan.message)
        assert plan.bracket is not None
        plan = Settlement("finish", plan.bracket, plan.bracket, True, plan.engines,
                          f"no engine answered: version {plan.bracket} announced")
    if plan.action == "refuse":
        raise BracketError(plan.message)
    if plan.action == "finish":
        if plan.open:
            b.end_weight_update(plan.version)
        else:
            b.queue.set_version(plan.version)
            log.warning("weight version %d announced after its bracket was aborted; "
                        "producers take it and put the engines back in rotation",
                        plan.version)
    elif plan.action == "undo":
        b.control.resume(b._open_version())
        b._open = None
        log.warning("weight update to version %s undone: the engines hold version %d; "
                    "producers resume on it", plan.bracket, plan.version)
    v = b.queue.current_version()
    b.engines.clear_fixed(v, found, may_clear(b.queue.storage, v))
    return plan

