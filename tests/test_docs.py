"""The documentation: a README a newcomer reads, and a site that builds with no broken link or API block."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_is_at_most_300_lines_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q -n 2" in text
    assert "bash scripts/setup.sh && .venv/bin/het-train" in text


def test_every_example_the_readme_names_exists_and_every_example_is_named() -> None:
    named = set(re.findall(r"`(examples/[A-Za-z0-9_]+\.py)`", README.read_text()))
    shipped = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")}
    assert named == shipped


def test_every_relative_link_of_the_readme_names_a_file() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into the docs"
    # CHANGELOG.md is the lead's to write; every other link must resolve now
    missing = [link for link in relative if not (ROOT / link).exists() and link != "CHANGELOG.md"]
    assert missing == []


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """What .ci/run runs: a broken link or anchor, a page missing from the nav, or an API block whose module
    is gone fails the build."""
    pytest.importorskip("mkdocs", reason="the docs extra (bash scripts/setup.sh --test installs it)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "core" / "index.html").exists()
