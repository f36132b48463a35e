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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from strawq.weights.control import ControlState
from strawq.weights.engine_weights import EngineProbe


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
