"""The import contract: which part of strawq may import which (docs/architecture.md, "Layers").

Every import statement in the package is read from the source (function-level imports too),
so a lazy import cannot slip past. The layers, bottom to top:

* the core (``strawq`` less the packages below): storage, records, states, leases, dataset,
  GC, doctor. Never Ray, torch or HTTP, never the parts above it;
* ``strawq.producers`` (HTTP, Ray through ``placement`` only) and ``strawq.collector``
  (torch on the trainer side): each over the core, neither over the other;
* ``strawq.demo``, ``strawq.testing``: drivers and harnesses over everything;
* ``strawq.app``: the composition root (the command line, the run config).
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
#: verl's fully-async queue is a Ray actor by verl's design: ``verl_queue.actor_class`` wraps
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
    assert "strawq.states" in IMPORTS["strawq.queue"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    bad = sorted(
        f"{name} imports {mod}"
        for name, mods in IMPORTS.items() if _layer(name) == layer
        for mod in mods for banned in FORBIDDEN[layer] if _under(mod, banned)
    )
    assert not bad, "\n".join(bad)


def test_only_placement_imports_ray() -> None:
    bad = sorted(f"{name} imports {mod}" for name, mods in IMPORTS.items()
                 if name not in RAY_MODULES for mod in mods if _under(mod, "ray"))
    assert not bad, "\n".join(bad)


def test_top_level_folders_refuse_a_second_identity() -> None:
    """``import producers`` from the repository root would load a second copy of each module."""
    import subprocess
    import sys

    for pkg in ("producers", "collector", "demo"):
        r = subprocess.run([sys.executable, "-c", f"import {pkg}"], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode != 0, pkg
        assert f"strawq.{pkg}" in r.stderr, r.stderr
