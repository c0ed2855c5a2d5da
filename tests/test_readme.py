"""The README stays true: its seam table is the registry's, and its commands exist."""

from __future__ import annotations

import os
import re

from memra_dsv4.__main__ import COMMANDS
from memra_dsv4.seams import SEAMS, seam_table_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def test_readme_seam_table_matches_registry():
    text = _readme()
    m = re.search(r"<!-- seams:begin[^>]*-->\n(.*?)<!-- seams:end -->", text, re.S)
    assert m, "README.md lost its seams:begin/end markers"
    assert m.group(1) == seam_table_markdown(), (
        "README seam table is stale: paste memra_dsv4.seams.seam_table_markdown() between the "
        "markers")
    for seam in SEAMS.values():
        assert seam.env.startswith("MEMRA_DSV4_")


def test_readme_names_the_two_commands_and_every_cli_command():
    text = _readme()
    assert "make demo" in text and "make test" in text
    for cmd in COMMANDS:
        assert f"| `{cmd}" in text, f"README's command table misses `{cmd}`"
