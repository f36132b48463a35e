"""Every test the documentation names exists: a doc that cites ``tests/x.py::test_y`` as the
proof of an invariant must not point at a file that moved or a test that was renamed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: ``tests/a/b.py``, optionally ``::name``, then any ``, `::other`` that continue the list
REF = re.compile(r"(tests/[\w/]+\.py)(::\w+)?((?:`?, `::\w+)*)")


def _refs() -> list[tuple[str, str, list[str]]]:
    out = []
    for doc in DOCS:
        for m in REF.finditer(doc.read_text(encoding="utf-8")):
            names = ([m.group(2)[2:]] if m.group(2) else []) + re.findall(r"::(\w+)",
                                                                          m.group(3) or "")
            out.append((doc.name, m.group(1), names))
    return out


def test_the_docs_cite_tests() -> None:
    refs = _refs()
    assert len(refs) > 30 and any(names for _, _, names in refs)


def test_every_cited_test_exists() -> None:
    missing = []
    for doc, path, names in _refs():
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{doc}: {path} does not exist")
            continue
        text = file.read_text(encoding="utf-8")
        for name in names:
            # a trailing ``_`` is a prefix (``test_corrupt_*`` in the text)
            pattern = rf"def {re.escape(name)}" + ("" if name.endswith("_") else r"\b")
            if not re.search(pattern, text):
                missing.append(f"{doc}: {path}::{name} is not defined there")
    assert not missing, "\n".join(missing)
