"""The import contract: which part of strawq may import which (docs/architecture.md, "Layers").

Every import statement in the package is read from the source (function-level imports and
``if TYPE_CHECKING:`` imports too), so a lazy import cannot slip past. The layers, bottom to
top:

* the core (``strawq`` less the packages below): storage, records, states, leases, dataset,
  GC, doctor. Never Ray, torch or HTTP, never the parts above it;
* ``strawq.producers`` (HTTP, Ray through ``placement`` only) and ``strawq.collector``
  (torch on the trainer side): each over the core, neither over the other;
* ``strawq.demo``, ``strawq.testing``: drivers and harnesses over everything;
* ``strawq.app``: the composition root (the command line, the run config).

Inside ``strawq.collector``, three sub-parts:

* the collector process (the modules directly in ``strawq.collector``: ``core``,
  ``admission``, ``ordering``, ``fencing``, ``resume``, ``mixing``, ``cli``, ``config``,
  ``errors``, and the package itself);
* ``strawq.collector.trainer``, the trainer-side library: never imports the collector
  process (what both need lives in the core);
* ``strawq.collector.integrations`` (slime, verl, Megatron-core): over the trainer library,
  never over the collector process nor the test harness (``strawq.testing``, which holds
  their gradient-check paths and the reference oracle).

And no import circles: the module-level import graph (an import of ``a.b.c`` is an edge to
the longest prefix of it that is a module) has no strongly connected component of more than
one module, but for the known ones in ``KNOWN_CYCLES``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Package folder -> the module prefix it is imported as.
FOLDERS = {
    ROOT / "strawq": "strawq",
    ROOT / "producers": "strawq.producers",
    ROOT / "collector": "strawq.collector",
    ROOT / "demo": "strawq.demo",
}
UPPER = ("strawq.producers", "strawq.collector", "strawq.demo", "strawq.testing", "strawq.app")
#: verl's fully-async queue is a Ray actor by verl's design: ``verl.queue.actor_class`` wraps
#: the durable queue with ``ray.remote`` (one function-level import), nothing else there uses Ray
RAY_MODULES = {"strawq.producers.placement", "strawq.collector.integrations.verl.queue"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, prefix in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if rel.parts[0] in ("producers", "collector", "demo") and folder.name == "strawq":
                continue  # the links: the same files under their own folder
            parts = [*rel.parts[:-1]] + ([] if rel.name == "__init__.py" else [rel.stem])
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    if name == "strawq.__main__":
        return "strawq.app"
    for upper in UPPER:
        if name == upper or name.startswith(upper + "."):
            return upper
    return "core"


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": (*UPPER, "torch", "aiohttp", "ray", "requests", "httpx"),
    "strawq.producers": ("strawq.collector", "strawq.demo", "strawq.testing", "strawq.app"),
    "strawq.collector": ("strawq.producers", "strawq.demo", "strawq.testing", "strawq.app"),
    "strawq.demo": ("strawq.app",),
    "strawq.testing": ("strawq.app",),
    "strawq.app": (),
}


def test_the_walk_sees_every_part() -> None:
    """A contract over nothing would pass: the walk must find each layer and its imports."""
    layers = {_layer(n) for n in MODULES}
    assert layers == {"core", *UPPER}
    assert sum(len(v) for v in IMPORTS.values()) > 300
    assert "strawq.tasks.states" in IMPORTS["strawq.tasks.queue"]
    parts = {_collector_part(n) for n in MODULES if _under(n, "strawq.collector")}
    assert parts == {"process", "trainer", "integrations"}
    assert set(COLLECTOR_PROCESS) <= set(MODULES), set(COLLECTOR_PROCESS) - set(MODULES)
    assert "strawq.collector.trainer.reader" in GRAPH["strawq.collector.integrations.slime.adapter"]
    assert "strawq.collector.trainer.packing" in GRAPH["strawq.collector.batching"]
    assert sum(len(v) for v in GRAPH.values()) > 300


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    bad = sorted(
        f"{name} imports {mod}"
        for name, mods in IMPORTS.items() if _layer(name) == layer
        for mod in mods for banned in FORBIDDEN[layer] if _under(mod, banned)
    )
    assert not bad, "\n".join(bad)


#: the collector process: every module directly in ``strawq.collector`` (and the package)
COLLECTOR_PROCESS = tuple(f"strawq.collector.{m}" for m in (
    "core", "admission", "ordering", "fencing", "resume", "mixing", "cli", "config", "errors",
    "hooks", "report", "eta_judge", "batching", "ops_metrics", "upkeep", "pass_metrics",
    "releasing", "run_end"))
TRAINER = "strawq.collector.trainer"
INTEGRATIONS = "strawq.collector.integrations"


def _collector_part(name: str) -> str:
    """``trainer``, ``integrations`` or ``process`` for a module under ``strawq.collector``."""
    for part, prefix in (("trainer", TRAINER), ("integrations", INTEGRATIONS)):
        if _under(name, prefix):
            return part
    return "process"


def _process_imports(prefixes: tuple[str, ...], banned_too: tuple[str, ...] = ()) -> list[str]:
    """Imports of the collector process (anything under ``strawq.collector`` outside the
    trainer library and the integrations, the package itself included) or of ``banned_too``
    by the modules under ``prefixes``."""
    return sorted(
        f"{name} imports {mod}"
        for name, mods in IMPORTS.items() if any(_under(name, p) for p in prefixes)
        for mod in mods
        if (_under(mod, "strawq.collector") and _collector_part(mod) == "process")
        or any(_under(mod, b) for b in banned_too))


def test_the_trainer_library_never_imports_the_collector_process() -> None:
    """The trainer side (reader, packing, bracket, importance, behaviour, metrics) sits on
    the core: ``strawq.tasks.epochs``, ``strawq.delivery.checkpoint``, ``strawq.errors`` hold
    what it shares with the collector process."""
    bad = _process_imports((TRAINER,), ("strawq.collector.integrations",))
    assert not bad, "\n".join(bad)


def test_the_integrations_sit_on_the_trainer_library() -> None:
    """slime, verl and Megatron-core adapters: never the collector process, never the test
    harness (their gradient-check paths live there and import them, not the reverse)."""
    bad = _process_imports((INTEGRATIONS,), ("strawq.testing",))
    assert not bad, "\n".join(bad)


@pytest.mark.process
def test_loading_the_trainer_side_loads_no_collector_process_module() -> None:
    """What the import statements say, at run time too: a trainer process that imports the
    reader and every integration runs ``strawq/collector/__init__.py`` first, which must not
    load the collector process (its exports load on first use)."""
    import subprocess
    import sys

    trainer_side = sorted(m for m in MODULES if _under(m, TRAINER) or _under(m, INTEGRATIONS))
    code = ("import importlib, sys\n"
            f"for m in {trainer_side!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ImportError as e:\n"  # an adapter whose framework is not installed
            "        print('skip', m, e, file=sys.stderr)\n"
            "print('\\n'.join(sorted(sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert f"{TRAINER}.reader" in loaded and f"{INTEGRATIONS}.verl.queue" in loaded
    bad = sorted(loaded & set(COLLECTOR_PROCESS))
    assert not bad, f"the trainer side loaded the collector process: {bad}"


def _target(mod: str) -> str | None:
    """The module an import of ``mod`` loads: its longest prefix that is a module."""
    parts = mod.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in MODULES:
            return prefix
    return None


#: module -> the project modules it imports (type-only imports included)
GRAPH: dict[str, set[str]] = {
    name: {t for t in map(_target, mods) if t is not None and t != name}
    for name, mods in IMPORTS.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def _a_cycle(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One import circle through ``comp``'s first module, as ``a -> b -> a``."""
    members, start = set(comp), comp[0]
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first: the shortest way back to the start
        node = todo.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return " -> ".join([*paths[node], start])
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                todo.append(nxt)
    return " <-> ".join(comp)


#: Import circles known and accepted, each closed only by an ``if TYPE_CHECKING:`` import
#: (annotations, never executed): ``generate`` names the runner's types in its protocols,
#: ``lab_report`` the lab's results. Exactly these: a new circle fails, and so does one of
#: these once it is gone (take it off the list).
KNOWN_CYCLES = [
    ["strawq.demo.lab", "strawq.demo.lab_report"],
]


def test_no_import_circles() -> None:
    """Modules that import each other (directly or round a longer loop) are one part in two
    files: an import order that half-initialises one of them, and no layer between them."""
    found = _cycles(GRAPH)
    new = [_a_cycle(GRAPH, c) for c in found if c not in KNOWN_CYCLES]
    assert not new, "import circles:\n" + "\n".join(new)
    assert found == KNOWN_CYCLES, f"a known circle is gone; update KNOWN_CYCLES: {found}"


def test_the_cycle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


def test_only_placement_imports_ray() -> None:
    bad = sorted(f"{name} imports {mod}" for name, mods in IMPORTS.items()
                 if name not in RAY_MODULES for mod in mods if _under(mod, "ray"))
    assert not bad, "\n".join(bad)


@pytest.mark.process
def test_top_level_folders_refuse_a_second_identity() -> None:
    """``import producers`` from the repository root would load a second copy of each module."""
    import subprocess
    import sys

    for pkg in ("producers", "collector", "demo"):
        r = subprocess.run([sys.executable, "-c", f"import {pkg}"], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode != 0, pkg
        assert f"strawq.{pkg}" in r.stderr, r.stderr


#: The core's parts, bottom to top (docs/architecture.md, "Layers"): each imports only the
#: parts before it. A top-level module (``strawq.errors``, ``strawq.config``, ...) is a part
#: of its own; ``strawq.liveness`` sits below storage (the POSIX backend asks whether a pid is
#: alive).
CORE_PARTS = (
    "strawq.errors",
    "strawq.config",
    "strawq.argtypes",
    "strawq.dotted",
    "strawq.ondisk",
    "strawq.liveness",
    "strawq.storage",
    "strawq.doctor",
    "strawq.tasks",
    "strawq.data",
    "strawq.delivery",
    "strawq.weights",
    "strawq.views",
)


def _core_part(name: str) -> int | None:
    """The index in ``CORE_PARTS`` of the part that holds core module ``name``."""
    for i, part in enumerate(CORE_PARTS):
        if _under(name, part):
            return i
    return None


def test_every_core_module_is_in_a_part() -> None:
    loose = sorted(n for n in MODULES
                   if _layer(n) == "core" and n != "strawq" and _core_part(n) is None)
    assert not loose, f"core modules in no part of CORE_PARTS: {loose}"


def test_the_core_parts_import_only_the_parts_below() -> None:
    bad = []
    for name, targets in GRAPH.items():
        mine = _core_part(name)
        if _layer(name) != "core" or mine is None:
            continue
        for t in targets:
            theirs = _core_part(t)
            if theirs is not None and theirs > mine:
                bad.append(f"{name} ({CORE_PARTS[mine]}) imports {t} ({CORE_PARTS[theirs]})")
    assert not bad, "\n".join(sorted(bad))
    assert any(_core_part(t) == CORE_PARTS.index("strawq.ondisk")
               for t in GRAPH["strawq.tasks.queue"])
