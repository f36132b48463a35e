"""The content digest of an installed slime source, to check it is the pinned commit's.

    python deploy/slime_digest.py            # prints the digest, exit 1 if it is not PINNED

sha256 over the installed ``slime`` package's ``*.py`` files in sorted order of their path
relative to the package's parent, each as ``path`` NUL ``size`` NUL ``bytes``. slime has no
registry release and an air-gapped cluster installs it from a local copy
(``make slime SLIME_SRC=/path``): this digest says whether that copy is the pinned commit's
source (docs/slime.md, Install). ``make slime`` runs it after the install.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

#: slime 0.3.1 at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515
PINNED = "8b82d3b53c0986fa9d12512d6d12a44f75010a28f2f8d020303c1da665d85c67"


def slime_digest(package_dir: str | None = None) -> str:
    """The digest of the ``slime`` package at ``package_dir`` (default: the installed one)."""
    if package_dir is None:
        spec = importlib.util.find_spec("slime")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("slime is not installed: make slime SLIME_SRC=pinned or "
                                    "SLIME_SRC=/path/to/a/local/copy (docs/slime.md, Install)")
        package_dir = list(spec.submodule_search_locations)[0]
    root = os.path.dirname(os.path.abspath(package_dir))
    files = []
    for base, dirs, names in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [os.path.join(base, n) for n in names if n.endswith(".py")]
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: os.path.relpath(p, root)):
        with open(path, "rb") as f:
            data = f.read()
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        got = slime_digest(args[0] if args else None)
    except FileNotFoundError as exc:
        print(f"slime_digest: {exc}", file=sys.stderr)
        return 2
    print(got)
    if got != PINNED:
        print(f"slime_digest: this slime source is not the pinned commit's (expected {PINNED})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
