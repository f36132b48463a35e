"""docs/troubleshooting.md: every case has its command, and every command line parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from strawq.app import cli

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _command_lines() -> list[str]:
    out = []
    for page in ("troubleshooting.md", "operations.md", "quickstart.md"):
        for block in re.findall(r"```bash\n(.*?)```", (DOCS / page).read_text(), re.S):
            for line in block.splitlines():
                line = line.split("  #", 1)[0].strip().removesuffix("&").strip()
                if line.startswith("strawq ") and "..." not in line and "\\" not in line \
                        and "$(" not in line and "…" not in line:
                    out.append(line)
    return out


def test_the_page_covers_every_case_of_the_operator_issue() -> None:
    page = (DOCS / "troubleshooting.md").read_text()
    for needle in ("strawq gc", "--tmp-of", "bracket abort", "--queue-config", "clamp(min=1)",
                   "check_reward_fn", "stray files", "--max-steps", "'default'",
                   "BrokenPipeError", "not empty", "TORCH_INDEX", "trainer/step", "--json"):
        assert needle in page, needle


@pytest.mark.parametrize("line", _command_lines())
def test_every_documented_command_parses(line: str) -> None:
    argv = shlex.split(line)[1:]
    args = cli.build_parser().parse_args(argv)
    assert getattr(args, "func", None) is not None, line
