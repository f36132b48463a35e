"""The collector's and the trainer library's central classes stay small: an optional
behaviour is a part they compose or a hook they call, not a branch inside them
(docs/architecture.md, "Features plug in")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: (file, class) -> the most lines from its ``class`` line to its end
CENTRAL = {
    ("collector/core.py", "Collector"): 300,
    ("collector/trainer/reader.py", "BatchReader"): 300,
    ("collector/trainer/bracket.py", "WeightUpdateBracket"): 300,
}
MODULE_LINES = 600


@pytest.mark.parametrize(("path", "name"), sorted(CENTRAL))
def test_a_central_class_stays_under_its_size(path: str, name: str) -> None:
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert len(found) == 1, f"{path} defines no class {name}"
    node = found[0]
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    assert lines <= CENTRAL[(path, name)], (
        f"{name} is {lines} lines (at most {CENTRAL[(path, name)]}): move an optional "
        "concern into a part it composes or a hook it calls")


def test_the_collector_and_trainer_modules_stay_under_600_lines() -> None:
    files = sorted([*(ROOT / "collector").glob("*.py"),
                    *(ROOT / "collector" / "trainer").glob("*.py")])
    assert len(files) > 20
    long = {str(f.relative_to(ROOT)): n for f in files
            if (n := len(f.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
