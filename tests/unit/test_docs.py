"""The README and the documentation site stay true (issue 50).

- The README is one screen's worth (at most 250 lines) and every link in it resolves.
- Every number of the README's headline table is in the committed benchmark result it links
  (a number not produced by a committed run cannot be quoted).
- The site: every page in the nav exists and every page is in the nav; where MkDocs is installed
  (the ``docs`` extra, as CI installs it) the strict build passes and its API reference holds
  every public name of coconet, coconet.optim, coconet.nn, coconet.pipeline and coconet.runtime.
- The tutorials' code excerpts point at sections that exist in the examples.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in _LINK.finditer(path.read_text()) if "://" not in m.group(1)]


def test_the_readme_is_one_screen_of_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_every_link_of_the_readme_resolves():
    broken = [link for link in _links(README) if not (ROOT / link).exists()]
    assert broken == []


def test_the_readme_starts_with_what_and_why_then_setup_examples_status():
    text = README.read_text()
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads[:3] == ["Set up", "Examples", "The DSL in one example"], heads
    assert "Status" in heads and "Documentation" in heads
    first_screen = "\n".join(text.splitlines()[:40])
    assert "faster" in first_screen or "gain" in first_screen  # why, before anything else
    assert "git clone" in text and "--index-url" in text  # clone first; torch's CPU wheels


def test_the_headline_numbers_come_from_the_committed_runs():
    """Each row of the table: its millisecond figures are in the result file it links (as
    written there, or rounded to the digits the README shows)."""
    lines = README.read_text().splitlines()
    rows = [r for r in lines if r.startswith("| ") and "](benchmarks/" in r]
    assert len(rows) >= 6
    for row in rows:
        target = re.search(r"\]\((benchmarks/results/[^)]+)\)", row).group(1)
        measured = [float(x) for x in re.findall(r"\d+\.\d+|\d+", (ROOT / target).read_text())]
        for number in re.findall(r"(\d+(?:\.\d+)?) ms", row):
            digits = len(number.partition(".")[2])
            assert any(round(x, digits) == float(number) for x in measured), (
                f"{number} ms is not in {target}: {row}")


def _nav_pages(nav) -> list[str]:
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _config() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML (comes with the docs extra)")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages(_config()["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def test_the_snippets_the_pages_include_exist():
    for page in DOCS.rglob("*.md"):
        for path, section in re.findall(r'--8<-- "([^":]+)(?::([\w-]+))?"', page.read_text()):
            text = (ROOT / path).read_text()
            if section:
                assert f"--8<-- [start:{section}]" in text, (page, path, section)
                assert f"--8<-- [end:{section}]" in text, (page, path, section)


@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="MkDocs is not installed (pip install -e '.[docs]'; CI installs it)")
def test_the_site_builds_strict_and_its_reference_covers_every_public_name(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    tool = ROOT / "tools" / "check_api_reference.py"
    spec = importlib.util.spec_from_file_location("check_api", tool)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.missing(site) == []
    # the command reference is the command's own --help
    assert "usage: coconet tune" in (site / "reference" / "cli" / "index.html").read_text()


def test_the_site_home_shows_the_readme_headline_table():
    def table(path: Path) -> list[str]:
        return [r for r in path.read_text().splitlines() if "](benchmarks/results/" in r]

    assert table(DOCS / "index.md") == table(README)
