"""The module map of docs/architecture.md names every module of the product, and nothing else.

A module counts as named only when its repository-relative path appears in backticks inside
the "Module map" section: ``collector/trainer/reader.py`` for a module, the folder with a
trailing slash (``collector/integrations/slime/``) for a package's ``__init__.py``. The walk
is the import contract's (``tests/test_layering.py``): the top-level ``producers/``,
``collector/`` and ``demo/`` folders, never their links under ``strawq/``. Both directions
fail: a module the map does not name, and a path the map names that is no module, so the map
cannot go stale either way.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layering import MODULES, ROOT

DOC = ROOT / "docs" / "architecture.md"
HEADING = "### Module map"
#: a backticked path under one of the product folders: a ``.py`` file or a folder ending in ``/``
NAMED = re.compile(r"`((?:strawq|producers|collector|demo)/[\w/]*?(?:\.py|/))`")


def _key(path: Path) -> str:
    """How the map names a module: its path, or its folder with ``/`` for a package."""
    rel = path.relative_to(ROOT)
    return f"{rel.parent.as_posix()}/" if rel.name == "__init__.py" else rel.as_posix()


def _map_section() -> str:
    """The text from the map's heading to the next heading of its level or above."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(HEADING) + len(HEADING)
    end = re.search(r"^#{1,3} ", text[start:], re.MULTILINE)
    return text[start:start + end.start()] if end else text[start:]


EXPECTED = {_key(path) for path in MODULES.values()}


def test_the_walk_and_the_section_are_not_empty() -> None:
    """A check over nothing would pass: the walk finds the product, the map is there."""
    assert len(EXPECTED) > 150
    assert {"strawq/", "collector/trainer/reader.py", "producers/engines/"} <= EXPECTED
    assert len(NAMED.findall(_map_section())) > 150


def test_every_module_is_in_the_map() -> None:
    section = _map_section()
    missing = sorted(k for k in EXPECTED if f"`{k}`" not in section)
    assert not missing, ("docs/architecture.md, Module map, does not name:\n"
                         + "\n".join(missing))


def test_every_path_the_map_names_is_a_module() -> None:
    stale = sorted(set(NAMED.findall(_map_section())) - EXPECTED)
    assert not stale, ("docs/architecture.md, Module map, names paths that are no module "
                       "(a package is named by its folder with a trailing slash):\n"
                       + "\n".join(stale))
